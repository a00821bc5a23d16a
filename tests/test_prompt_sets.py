"""The shipped prompt sets: data/, its README and tpkit.prompt_sets.SHIPPED agree; splits are disjoint."""

import json
from pathlib import Path

from typer.testing import CliRunner

from tpkit.cli import app
from tpkit.prompt_sets import DATA, SHIPPED

NOT_PROMPTS = {"README.md", "LICENSE-tpgrpo-prompts"}


def _prompts(name: str) -> list[str]:
    lines = (DATA / name).read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines] if name.endswith(".jsonl") else lines


def test_every_file_in_data_is_declared_with_its_size():
    on_disk = {p.name for p in DATA.iterdir()} - NOT_PROMPTS
    assert on_disk == {s.file for s in SHIPPED}
    for s in SHIPPED:
        prompts = _prompts(s.file)
        assert len(prompts) == s.prompts and all(p.strip() for p in prompts), s.file
        assert len(set(prompts)) == len(prompts) or s.file.startswith("shapes-"), s.file  # shapes repeat as GenEval does


def test_data_readme_lists_every_set_with_its_size():
    readme = (DATA / "README.md").read_text()
    for s in SHIPPED:
        assert f"| {s.file} | {s.prompts} |" in readme, s.file


def test_train_and_test_splits_share_no_prompt():
    for train, test in (("pickscore-sfw-train.txt", "pickscore-sfw-test.txt"), ("ocr-prompts.txt", "ocr-test.txt"),
                        ("shapes-train.jsonl", "shapes-test.jsonl")):
        assert not set(_prompts(train)) & set(_prompts(test)), (train, test)


def test_release_files_keep_their_licence_and_attribution():
    assert "MIT License" in (DATA / "LICENSE-tpgrpo-prompts").read_text()
    readme = (DATA / "README.md").read_text()
    assert "YunzeTong/TurningPoint-GRPO" in readme and "994d26a63b65dbeba3260286317c137453cf3070" in readme


def test_prompts_list_prints_every_set():
    result = CliRunner().invoke(app, ["prompts", "list"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for s in SHIPPED:
        assert s.file in result.output
    assert "missing" not in result.output


def test_recipes_evaluate_on_prompts_they_never_train_on():
    from tpkit.config import load_recipe

    recipes = sorted((DATA.parent / "pipelines").glob("*.toml"))
    assert len(recipes) >= 9
    for path in recipes:
        r = load_recipe(path)
        if not r.eval_every or not r.eval.prompts:  # no evaluation, or GenEval's own 553 prompts
            continue
        train, test = (Path(p).name for p in (r.rollout.prompts, r.eval.prompts))
        assert not set(_prompts(train)) & set(_prompts(test)), path.name
    pickscore = load_recipe(DATA.parent / "pipelines" / "sd35m-tpgrpo-pickscore.toml")
    assert Path(pickscore.rollout.prompts).name == "pickscore-sfw-train.txt"
    assert Path(pickscore.eval.prompts).name == "pickscore-sfw-test.txt"
