"""What a user has before following docs/experiments.md, made on CPU: a working directory with the
repository's configs, tiny Hugging Face checkpoints (with a tokenizer) where the docs put the real
ones, and the `megapkl` command run the way the console script runs it.

`megapkl(*argv)` calls `megapkl.cli:main` (the console script's entry point) in a forked child
of the test process: the child inherits the already imported torch and megatron-core (seconds per
command saved), has its own torch.distributed state, and may fork ranks of its own (`megapkl
train` with data parallelism). Its stdout and stderr, at the file-descriptor level, come back.

`doc_commands(path)` reads every `megapkl ...` command of a Markdown file's bash blocks.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from megapkl.parallel.forked import collected_before_fork

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "tests" / "models"


@dataclass
class Result:
    argv: list[str]
    rc: int
    out: str
    err: str

    def ok(self) -> "Result":
        assert self.rc == 0, (f"megapkl {shlex.join(self.argv)} -> exit {self.rc}\n"
                              f"stdout:\n{self.out[-3000:]}\nstderr:\n{self.err[-3000:]}")
        return self


def _child(argv: list[str], out: str, err: str) -> None:
    rc = 1
    try:
        for fd, path in ((1, out), (2, err)):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(f, fd)
            os.close(f)
        sys.stdout = open(1, "w", closefd=False, buffering=1)
        sys.stderr = open(2, "w", closefd=False, buffering=1)
        import torch

        torch.set_num_threads(1)  # GNU OpenMP is not fork-safe once the parent used it
        from megapkl.cli import main

        rc = main(argv)
    except SystemExit as exc:  # argparse
        rc = exc.code if isinstance(exc.code, int) else 2
    except BaseException:  # noqa: BLE001 - report it, whatever it is
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def megapkl(*argv: str, timeout: float = 600.0) -> Result:
    """`megapkl ARGV...` in a forked child (working directory: the test's)."""
    import tempfile

    argv = [str(a) for a in argv]
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        proc = mp.get_context("fork").Process(target=_child, args=(argv, out, err))
        with collected_before_fork():  # the child must not finalize this process's garbage
            proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise AssertionError(f"megapkl {shlex.join(argv)} did not finish in {timeout:.0f} s")
        return Result(argv, proc.exitcode, Path(out).read_text(), Path(err).read_text())


# ---- the tiny twins of the papers' checkpoints


def write_tokenizer(path: Path) -> None:
    """A character-level Hugging Face tokenizer (99 ids, within the tiny models' 128) with
    Qwen's ChatML special tokens and chat template: the math prompts of the papers' data go
    through `data.prompt_template: qwen_math` exactly as with Qwen's own tokenizer."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=" "))
    tok.add_special_tokens(specials)
    tok.decoder = decoders.Fuse()
    chatml = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                            pad_token="<|endoftext|>", chat_template=chatml).save_pretrained(path)


def write_checkpoint(path: Path, moe: bool) -> None:
    """configs/models/tiny-qwen3(-moe).yaml as a Hugging Face checkpoint directory + tokenizer."""
    sys.path.insert(0, str(MODELS))
    try:
        from tiny_models import make_checkpoint
    finally:
        sys.path.remove(str(MODELS))
    make_checkpoint(str(path), moe=moe, seed=3, eos_token_id=2, pad_token_id=0, bos_token_id=None)
    write_tokenizer(path)


# ---- commands of a Markdown file


def doc_commands(path: Path) -> list[str]:
    """Every `megapkl ...` command in the ```bash blocks of `path`: backslash continuations
    joined, `# comments` and `;` separated commands split, whitespace normalized."""
    text = path.read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            for part in line.split(" ; "):
                if part.startswith("megapkl "):
                    commands.append(" ".join(part.split()))
    return commands


def argv_of(command: str, substitutions: dict[str, str]) -> list[str]:
    """The argv (without `megapkl`) of a documented command after replacing what names the
    user's cluster (each substitution must occur, so a changed doc cannot slip by)."""
    for old, new in substitutions.items():
        assert old in command, f"'{old}' no longer occurs in the documented command: {command}"
        command = command.replace(old, new)
    argv = shlex.split(command)
    assert argv[0] == "megapkl", command
    return argv[1:]
