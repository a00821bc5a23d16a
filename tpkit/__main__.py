from tpkit.cli import main

main()
