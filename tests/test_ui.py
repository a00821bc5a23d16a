"""Terminal output (tpkit.ui): what a distributed launch's processes draw."""

from __future__ import annotations

from tpkit.ui import track


def test_only_each_machines_first_process_draws_a_progress_bar(monkeypatch, capfd):
    """Under `accelerate launch`/`torchrun` every process runs the stage: only local rank 0 draws (the
    others' bars would interleave in the machine's log), labelled with whose share it counts; a second
    machine's first process draws its own."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    for rank, local in ((1, 1), (3, 1)):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(local))
        with track(3, "sampling") as advance:
            advance(3)
        assert "sampling" not in capfd.readouterr().err
    for rank in (0, 2):  # each machine's first process
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", "0")
        with track(3, "sampling") as advance:
            advance(3)
        err = " ".join(capfd.readouterr().err.split())
        assert "sampling" in err and f"process {rank}'s share, of 4" in err and "3/3" in err
