"""How the embedded engine writes pushed weights: staged (all checked, then written) or streamed
(checked and written piece by piece, one read of the bytes), and the torn state a streamed write
that fails half-way leaves behind until every parameter is written again."""
from __future__ import annotations

import pytest
import torch

from rollout_tiny import DENSE

from megapkl.parallel.threads import torch_threads
from megapkl.rollout import weight_write as WW
from megapkl.rollout.embedded import EmbeddedEngine, checkpoint_tensors
from megapkl.rollout.engine import RolloutEngineError, SamplingParams, WeightUpdateError
from megapkl.rollout.sample import PromptItem

PROMPT = [PromptItem([1, 2, 3])]
ONE = SamplingParams(max_new_tokens=1)


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(WW, "PIECE_BYTES", 256)  # 64 fp32 values: every matrix is many pieces


def _shifted(model, scale: float):
    return [(n, t + scale) for n, t in checkpoint_tensors(model)]


def _weights(engine):
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def test_streamed_writes_what_staged_writes(dense_model, small_pieces):
    staged, streamed = EmbeddedEngine(DENSE), EmbeddedEngine(DENSE)
    for e in (staged, streamed):
        e.update_weights(checkpoint_tensors(dense_model), version=0)
    new = _shifted(dense_model, 0.5)
    staged.update_weights(new, version=1)
    streamed.update_weights(new, version=1, streamed=True)
    a, b = _weights(staged), _weights(streamed)
    assert all(torch.equal(a[n], b[n]) for n in a) and streamed.version == 1
    # converted as the engine holds it: a bf16 engine takes fp32 tensors, rounded alike
    half = EmbeddedEngine(DENSE, dtype=torch.bfloat16)
    half.update_weights(checkpoint_tensors(dense_model), version=0)
    half.update_weights(new, version=1, streamed=True)
    assert all(torch.equal(half.model.state_dict()[n], t.to(torch.bfloat16)) for n, t in new)


def test_a_bad_first_piece_writes_nothing(dense_model, small_pieces):
    engine = EmbeddedEngine(DENSE)
    engine.update_weights(checkpoint_tensors(dense_model), version=0)
    before = _weights(engine)
    named = _shifted(dense_model, 0.5)
    name, t = named[0]
    t = t.clone()
    t.view(-1)[3] = float("nan")
    with pytest.raises(WeightUpdateError, match=f"'{name}': contains NaN or Inf") as err:
        engine.update_weights([(name, t)] + named[1:], version=1, streamed=True)
    assert not isinstance(err.value, WW.TornWrite)
    after = _weights(engine)
    assert all(torch.equal(before[n], after[n]) for n in before) and engine.version == 0
    assert engine.generate(PROMPT, 1, ONE)[0].version == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 3.4e38])  # the last: inf in bf16
def test_a_bad_later_piece_tears_the_weights_until_all_are_written(dense_model, small_pieces,
                                                                   bad):
    engine = EmbeddedEngine(DENSE, dtype=torch.bfloat16)
    engine.update_weights(checkpoint_tensors(dense_model), version=0)
    named = _shifted(dense_model, 0.5)
    i = next(i for i, (_, t) in enumerate(named) if t.numel() * 4 > 4 * WW.PIECE_BYTES)
    name, t = named[i]
    t = t.clone()
    t.view(-1)[-1] = bad  # in the tensor's last piece: the earlier ones are written already
    with pytest.raises(WW.TornWrite, match=f"'{name}': contains NaN or Inf"):
        engine.update_weights(named[:i] + [(name, t)], version=1, streamed=True)
    assert engine.version == 0 and engine.health()["weights_loaded"] is False
    with pytest.raises(RolloutEngineError, match=f"torn.*'{name}': contains NaN or Inf"):
        engine.generate(PROMPT, 1, ONE)
    engine.update_weights(named[:-1], version=2, streamed=True)  # all but one: still torn
    with pytest.raises(RolloutEngineError, match="torn"):
        engine.generate(PROMPT, 1, ONE)
    engine.update_weights(named[-1:], version=3)  # the last one, staged: every one written
    assert engine.health()["weights_loaded"] is True
    assert engine.generate(PROMPT, 1, ONE)[0].version == 3


def test_anything_raised_between_written_pieces_tears_them(dense_model, small_pieces,
                                                          monkeypatch):
    """Not only a bad value: an interrupt or an error after some pieces were written leaves the
    weights torn as well."""
    engine = EmbeddedEngine(DENSE)
    engine.update_weights(checkpoint_tensors(dense_model), version=0)
    calls, finite = [0], WW.finite

    def interrupted(value):
        calls[0] += 1
        if calls[0] == 3:  # the first tensor's third piece: two are written
            raise KeyboardInterrupt
        return finite(value)

    monkeypatch.setattr(WW, "finite", interrupted)
    named = [(n, t) for n, t in _shifted(dense_model, 0.5) if t.numel() * 4 > 2 * WW.PIECE_BYTES]
    with pytest.raises(KeyboardInterrupt):
        engine.update_weights(named, version=1, streamed=True)
    with pytest.raises(RolloutEngineError, match="torn.*KeyboardInterrupt"):
        engine.generate(PROMPT, 1, ONE)


def test_finite_reads_past_an_overflowing_sum():
    assert WW.finite(torch.tensor([3e38, 3e38]))  # the sum overflows, the values are finite
    assert WW.finite(torch.empty(0))
    for bad in (float("nan"), float("inf"), -float("inf")):
        assert not WW.finite(torch.tensor([1.0, bad, 2.0]))
        assert not WW.finite(torch.tensor([1.0, bad], dtype=torch.bfloat16))


def test_torch_threads_for_the_block_and_back():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch_threads(1):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), torch_threads(1):
            raise RuntimeError
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def _pool_threads():
    import threading

    return [t for t in threading.enumerate() if t.name == "megapkl-weight-write"]


@pytest.mark.parametrize("threads", [2, 3])
def test_pieces_shared_among_threads_write_everything(threads):
    """StreamedWrite hands the pieces to `threads` threads, each running torch on one thread,
    and joins its helpers before it returns."""
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (1000, 7, 333)]
    new = [torch.randn(p.shape) for p in params]
    seen = []

    def recorded(jobs):
        for job in jobs:
            yield lambda job=job: (seen.append(torch.get_num_threads()), job())

    writer = WW.StreamedWrite(threads)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(WW, "PIECE_BYTES", 64)  # 16 fp32 values a piece
        jobs = WW.streamed_jobs((f"w{i}", t, p) for i, (t, p) in enumerate(zip(new, params)))
        writer.run(recorded(jobs))
    assert all(torch.equal(p, t) for p, t in zip(params, new))
    assert writer.written == len(seen) == 63 + 1 + 21 and set(seen) == {1}
    assert not _pool_threads()


def test_a_bad_piece_among_threads_tears_and_joins(monkeypatch):
    monkeypatch.setattr(WW, "PIECE_BYTES", 64)
    param, t = torch.nn.Parameter(torch.zeros(4000)), torch.ones(4000)
    t[-1] = float("nan")
    writer = WW.StreamedWrite(2)
    with pytest.raises(WW.TornWrite, match="'w': contains NaN or Inf"):
        writer.run(WW.streamed_jobs([("w", t, param)]))
    assert writer.written >= 1 and float(param.detach()[0]) == 1.0 and not _pool_threads()
    # an interrupt raised on a helper thread reaches the caller, the helpers joined
    jobs = WW.streamed_jobs([("w", torch.ones(4000), param)])

    def interrupted():
        for i, job in enumerate(jobs):
            yield job if i != 5 else (lambda: (_ for _ in ()).throw(KeyboardInterrupt))

    with pytest.raises(KeyboardInterrupt):
        WW.StreamedWrite(2).run(interrupted())
    assert not _pool_threads()


def test_write_threads_follow_torch_on_cpu_within_a_cap_and_one_off_it():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert WW.write_threads(torch.device("cpu")) == 2
        torch.set_num_threads(WW.MAX_WRITE_THREADS + 4)
        assert WW.write_threads(torch.device("cpu")) == WW.MAX_WRITE_THREADS
        assert WW.write_threads(torch.device("cuda", 0)) == 1
    finally:
        torch.set_num_threads(threads)
