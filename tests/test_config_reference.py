"""docs/config.md is what `megapkl config reference` writes from the typed config, and says
something about every key."""
import dataclasses
import typing
from pathlib import Path

from megapkl.cli import main
from megapkl.config import RunConfig
from megapkl.config.reference import field_comments, render, rows, sections

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def test_docs_config_md_is_the_generated_reference():
    assert DOC.read_text(encoding="utf-8") == render(), (
        "docs/config.md differs from the typed config: run "
        "`megapkl config reference --out docs/config.md` and commit the result")


def test_every_key_of_every_section_is_documented():
    """Walks the dataclasses on its own: every field of every section is a row, with a type,
    a default and a comment in the source beside the field."""
    def keys(cls, prefix=""):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                yield from keys(hints[f.name], f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}"

    documented = {key: (tp, default, note) for prefix, cls in sections()
                  for key, tp, default, _, note in rows(cls, prefix)}
    expected = set(keys(RunConfig))
    assert expected <= set(documented)
    assert {k for k in documented if k.startswith("eval.benchmarks[].")} == {
        "eval.benchmarks[].name", "eval.benchmarks[].greedy", "eval.benchmarks[].n_samples",
        "eval.benchmarks[].path", "eval.benchmarks[].scoring"}
    silent = sorted(k for k, (tp, default, note) in documented.items() if not (tp and default and note))
    assert not silent, f"keys without a comment in megapkl/config/: {silent}"


def test_ranges_defaults_and_comments_come_from_the_source():
    table = {key: (tp, default, rng, note) for prefix, cls in sections()
             for key, tp, default, rng, note in rows(cls, prefix)}
    assert table["rollout.protocol"][:2] == (
        "'on_policy' | 'periodic_refresh' | 'controlled_staleness' | 'uniform_stale'",
        "periodic_refresh")
    assert table["rollout.top_p"][2] == "> 0, <= 1"
    assert table["train.steps"][1:3] == ("2000", ">= 1")
    assert "unset: 64 (periodic_refresh)" in table["rollout.refresh_every"][3]
    assert table["checkpoint.keep"][1] == "3" and "null: all" in table["checkpoint.keep"][3]
    assert table["eval.benchmarks"][1].startswith("[{name: math500, greedy: true, n_samples: 1}")
    # a comment over several lines above a field, then its own line's comment
    from megapkl.config.sections import ParallelConfig

    note = field_comments(ParallelConfig)["max_tokens_per_micro_batch"]
    assert note.startswith("Token-balanced micro-batches:") and note.endswith("micro-batches.")


def test_config_reference_command(tmp_path, capsys):
    assert main(["config", "reference"]) == 0
    assert capsys.readouterr().out == render()
    out = tmp_path / "config.md"
    assert main(["config", "reference", "--out", str(out)]) == 0
    assert out.read_text() == render()
