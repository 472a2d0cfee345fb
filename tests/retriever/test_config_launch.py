"""The env.search config, the answer_em reward type, and the retriever's Slurm step."""
import pytest

from megapkl.config.sections_env import EnvConfig
from megapkl.config.typed import ConfigError, build


def env(**search):
    return build(EnvConfig, {"type": "search", "search": search}, key="env", source="run.yaml")


def test_search_needs_one_retriever():
    assert env(url="http://127.0.0.1:8000/retrieve").search.topk == 3  # Search-R1's topk
    with pytest.raises(ConfigError, match="needs a retriever"):
        env()
    with pytest.raises(ConfigError, match="not both"):
        env(url="http://h:1/retrieve", index="ix")
    with pytest.raises(ConfigError, match="http\\(s\\) URL"):
        env(url="127.0.0.1:8000")
    with pytest.raises(ConfigError, match="env.search.url.*env.type: search only"):
        build(EnvConfig, {"search": {"url": "http://h:1/retrieve"}}, key="env", source="x")


def test_step_timeout_must_cover_the_retries():
    with pytest.raises(ConfigError, match=r"env.timeout_s.*one search may take 46.505 s"):
        env(url="http://h:1/retrieve", timeout_s=15.0)


def test_answer_em_reward_from_config():
    from megapkl.config.sections_train import RewardConfig
    from megapkl.rollout.rewards import AnswerEMReward, build_reward

    r = build_reward(build(RewardConfig, {"type": "answer_em", "incorrect": 0.0}))
    assert isinstance(r, AnswerEMReward) and (r.correct, r.incorrect) == (1.0, 0.0)


def test_srun_step_on_the_profiles_node():
    from megapkl.launch.retriever import RetrieverPlacement, srun_launcher, to_env

    cmd = ["python", "-m", "megapkl.retriever", "serve", "--host", "0.0.0.0"]
    launch = srun_launcher(RetrieverPlacement(node=-1, gpus=1, mem="72G"), ["n1", "n2"])
    step, reach = launch(cmd, "0.0.0.0")
    assert step[:8] == ["srun", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=n2",
                        "--mem=72G", "--cpus-per-task=8", "--gpus=1"] and step[8:] == cmd
    assert reach == "n2"
    with pytest.raises(ValueError, match="env.search.host 127.0.0.1: .* cannot reach loopback"):
        launch(cmd, "127.0.0.1")
    one = srun_launcher(RetrieverPlacement(node=0), ["n1"])
    assert one(cmd, "127.0.0.1")[1] == "127.0.0.1"  # one node: the trainer is on it
    with pytest.raises(ValueError, match="retriever.node 3: the allocation has 2"):
        srun_launcher(RetrieverPlacement(node=3), ["n1", "n2"])
    assert "MEGAPKL_RETRIEVER_STEP" in to_env(RetrieverPlacement()) and to_env(None) == {}


def test_profile_places_the_retriever():
    from megapkl.launch.profile import loads_profile

    prof = loads_profile("partition: gpu\nnode_gpus: 8\nretriever:\n  node: 0\n  gpus: 1\n"
                         "  mem: 80G\n", source="p.yaml")
    assert (prof.retriever.node, prof.retriever.gpus, prof.retriever.mem) == (0, 1, "80G")
    with pytest.raises(ConfigError, match="retriever.mem"):
        loads_profile("partition: gpu\nretriever:\n  mem: lots\n", source="p.yaml")
