"""Learning regression: a seeded short run of the CPU demo task must learn.

The demo task (next_mod10, reward +-1 on the first response token) from a random init: chance
accuracy is ~0.10. With the demo's Proximal KL objective, on-policy batches (refresh every update),
one response token and lr 1e-2, the seeded run (seed 0, one process) was measured at a mean
training accuracy of 0.534 over updates 28-35 (0.089 over updates 0-7), about 20 s on one core.
The test asks for >= 0.30 there: far above chance, well below what a working trainer reaches. A
broken learning signal fails it: with the advantage sign flipped in the rollout stage the same
run was measured at 0.009 over updates 28-35. Every piece runs for real: megatron-core model, embedded engine,
HF weight export, rewards, advantages, the distributed loss and megatron's optimizer.
"""
from megapkl.config import load_config
from megapkl.train.metrics_log import read_metrics

STEPS, WINDOW, TARGET = 36, 8, 0.30
LEARN = ["parallel.data=1", f"train.steps={STEPS}", "train.lr=1e-2", "rollout.max_response_len=1",
         "rollout.prompts_per_batch=10", "rollout.refresh_every=1", "reference.refresh_every=1",
         "logging.progress_bar=false", "logging.tensorboard=false", "checkpoint.every=0"]


def test_demo_task_learns_within_36_updates(dist_run, tmp_path):
    from megapkl.train.local import _rank_main

    cfg = load_config("configs/demo/cpu_demo.yaml", [*LEARN, f"run_dir={tmp_path / 'learn'}"])
    dist_run(_rank_main, 1, cfg, timeout=300)
    acc = [r["train/accuracy"] for r in read_metrics(cfg.run_dir)]
    assert len(acc) == STEPS
    first, last = sum(acc[:WINDOW]) / WINDOW, sum(acc[-WINDOW:]) / WINDOW
    print(f"\n[learning] mean train/accuracy: updates 0-{WINDOW - 1}: {first:.3f}, updates "
          f"{STEPS - WINDOW}-{STEPS - 1}: {last:.3f} (target >= {TARGET})")
    assert last >= TARGET, f"the demo task did not learn: accuracy {first:.3f} -> {last:.3f} " \
                           f"in {STEPS} updates (target >= {TARGET}); curve {[round(a, 2) for a in acc]}"
