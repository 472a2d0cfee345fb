"""Hand-computed values for the objective library, and the library's import hygiene."""
import ast
import math
import pathlib
import random
import subprocess
import sys

import pytest
import torch

from megapkl.objectives import PolicyLossConfig, TokenBatch, policy_loss
from megapkl.objectives.credit import future_kl_credit
from megapkl.objectives.sis import mix64, mix64_int
from megapkl.objectives.tetpo import temper_groups

ROOT = pathlib.Path(__file__).resolve().parents[1]


def one_response(l):
    n = len(l)
    return (torch.tensor(l, dtype=torch.float64), torch.zeros(n, dtype=torch.int64),
            torch.arange(1, n + 1), torch.tensor([n]))


@pytest.mark.parametrize("horizon,tail,expected", [
    # c = clip([0.1, -0.2, 0.03, 0.5], +-0.05) = [0.05, -0.05, 0.03, 0.05], beta = 0.5
    ("full", "none", [0.04, 0.015, 0.04, 0.025]),
    (2, "none", [0.0, -0.01, 0.04, 0.025]),
    (1, "none", [0.025, -0.025, 0.015, 0.025]),
    (9, "none", [0.04, 0.015, 0.04, 0.025]),
    # H = 1 with linear tail: t=1 -> c1 + (3/4 c2 + 2/4 c3 + 1/4 c4) = 0.04; t=3 -> c3 + c4/2 = 0.055
    (1, "linear", [0.02, 0.5 * (-0.05 + (2 / 3) * 0.03 + (1 / 3) * 0.05), 0.0275, 0.025]),
])
def test_credit_hand_values(horizon, tail, expected):
    l, ridx, pos, lengths = one_response([0.1, -0.2, 0.03, 0.5])
    c = future_kl_credit(l, ridx, pos, lengths, beta=0.5, horizon=horizon, cost_clip=0.05, tail=tail)
    assert torch.allclose(c, torch.tensor(expected, dtype=torch.float64), atol=1e-12), c


def test_credit_no_clip_and_second_response_independent():
    l = torch.tensor([1.0, 2.0, 10.0, 20.0, 30.0], dtype=torch.float64)
    ridx = torch.tensor([0, 0, 1, 1, 1])
    pos = torch.tensor([1, 2, 1, 2, 3])
    c = future_kl_credit(l, ridx, pos, torch.tensor([2, 3]), beta=1.0, horizon="full", cost_clip=None)
    assert c.tolist() == [3.0, 2.0, 60.0, 50.0, 30.0]


def test_mix64_matches_python_definition():
    rng = random.Random(0)
    xs = [rng.randrange(-(1 << 63), 1 << 63) for _ in range(200)] + [0, -1, (1 << 63) - 1, -(1 << 63)]
    got = mix64(torch.tensor(xs, dtype=torch.int64)).tolist()
    for x, g in zip(xs, got):
        assert g & ((1 << 64) - 1) == mix64_int(x & ((1 << 64) - 1))


def pg_batch():
    logp = torch.log(torch.tensor([0.5, 0.25], dtype=torch.float64)).requires_grad_()
    return TokenBatch(logp=logp, logp_behav=torch.log(torch.tensor([0.25, 0.25], dtype=torch.float64)),
                      advantages=torch.tensor([1.0, 1.0], dtype=torch.float64),
                      response_index=torch.tensor([0, 0]), group_index=torch.tensor([0]),
                      positions=torch.tensor([1, 2]))


def test_pg_and_grpo_hand_values():
    # w = [2, 1], A = 1: pg loss = -(2 + 1)/2; grpo: rho = w, token 1 clipped (A > 0, rho > 1.2)
    out = policy_loss(PolicyLossConfig.from_dict({"name": "pg"}), pg_batch())
    assert out.loss.item() == pytest.approx(-1.5)
    assert out.coef.tolist() == pytest.approx([2.0, 1.0])
    out = policy_loss(PolicyLossConfig.from_dict({"name": "grpo"}), pg_batch())
    assert out.loss.item() == pytest.approx(-(1.2 + 1.0) / 2)
    assert out.coef.tolist() == pytest.approx([0.0, 1.0])
    assert out.metrics["clip/frac"] == pytest.approx(0.5)


def test_tetpo_two_member_group_closed_form():
    # L = [0, ln 3]: ESS(1) = 16/10 = 0.8 G < 0.85 G. ESS(a) = 1.7 <=> 0.7 x^2 - 2 x + 0.7 = 0, x = 3^a
    x = (2 + math.sqrt(4 - 4 * 0.49)) / 1.4
    alpha = math.log(x) / math.log(3)
    a, wt = temper_groups(torch.tensor([0.0, math.log(3)], dtype=torch.float64), torch.tensor([7, 7]), kappa=0.85, n_iter=40)
    assert a.tolist() == pytest.approx([alpha, alpha], abs=1e-9)
    assert wt.tolist() == pytest.approx([2 / (1 + x), 2 * x / (1 + x)], abs=1e-8)


def test_unknown_objective_key_is_named():
    with pytest.raises(ValueError, match="objective.bta.*did you mean 'beta'"):
        PolicyLossConfig.from_dict({"name": "proximal_kl", "bta": 0.3})


def test_objectives_import_no_distributed_or_megatron():
    """`megapkl.objectives` is pure math: no torch.distributed, megatron, submitit or HF imports."""
    banned = ("megatron", "torch.distributed", "submitit", "transformers", "math_verify")
    for path in (ROOT / "megapkl" / "objectives").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert not name.startswith(banned), f"{path.name} imports {name}"
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('megatron', 'submitit', 'transformers', 'math_verify'):\n"
            "            raise ImportError('blocked: ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import megapkl.objectives\n"
            "from megapkl.objectives import PolicyLossConfig, TokenBatch, policy_loss\n"
            "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_baseline_perturbation_shifts_the_advantage_and_nothing_else():
    """PKL C.3 / Fig. 7 (`advantage.perturb_baseline`): A' = A + 1 in groups with non-constant
    rewards, rewards and within-group differences unchanged; Proximal KL's credit is computed as
    usual and subtracted after the shift (coef' - coef = w I_g); GRPO's clip gate reacts to it."""
    import sys as _sys
    _sys.path.insert(0, str(ROOT / "tests"))
    from reference.gen import make_batch, to_token_batch

    rewards = [1.0, 0.0, 1.0, 0.0] + [1.0] * 4 + [0.0, 0.0, 1.0, 1.0]   # group 1 is constant
    clean = make_batch(7, M=12, G=4, rewards=rewards, adv_mode="group_std")
    from megapkl.objectives.advantages import compute_advantages
    ridx = clean["response_index"]
    pert = dict(clean)
    pert["advantages"] = compute_advantages(torch.tensor(rewards, dtype=torch.float64), clean["group_index"],
                                            "group_std", perturb_baseline=True)[ridx]
    shift = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)[clean["group_index"][ridx]]
    torch.testing.assert_close(pert["advantages"] - clean["advantages"], shift, rtol=0, atol=1e-12)
    out = {}
    for name in ("proximal_kl", "grpo"):
        cfg = PolicyLossConfig.from_dict({"name": name})
        out[name] = [policy_loss(cfg, to_token_batch(d)[0]) for d in (clean, pert)]
    c, p = out["proximal_kl"]
    w = torch.exp(clean["logp"] - clean["logp_behav"])
    torch.testing.assert_close(p.coef - c.coef, w * shift, rtol=1e-10, atol=1e-12)
    assert p.metrics["pkl/credit_mean"] == c.metrics["pkl/credit_mean"]
    c, p = out["grpo"]
    assert p.metrics["clip/frac"] != c.metrics["clip/frac"]   # the sign-dependent gate moves
