"""megapkl.analysis.environment: the record a study keeps beside each run."""
import json
import os
import platform
from importlib import metadata

import torch

from megapkl.analysis import environment as envmod

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse4_2 avx avx2 fma avx512f amx_tile

processor\t: 1
model name\t: another model, never read
flags\t\t: fpu
"""


def test_cpu_info_reads_the_first_processor():
    assert envmod.cpu_info(CPUINFO) == {"model": "Intel(R) Xeon(R) Platinum 8480+",
                                        "simd": ["sse4_2", "avx", "avx2", "fma", "avx512f", "amx_tile"]}
    assert envmod.cpu_info("") == {"model": None, "simd": []}


def test_package_versions_name_missing_packages_none():
    got = envmod.package_versions(("numpy", "no-such-distribution-megapkl"))
    assert got == {"numpy": metadata.version("numpy"), "no-such-distribution-megapkl": None}


def test_environment_records_this_process(tmp_path):
    (tmp_path / "cpuinfo").write_text(CPUINFO)
    env = envmod.environment(tmp_path / "cpuinfo")
    json.dumps(env)  # goes into runs.json as it is
    assert env["python"] == platform.python_version()
    assert env["packages"]["torch"] == metadata.version("torch")
    assert set(env["packages"]) == set(envmod.PACKAGES)
    t = env["torch"]
    assert (t["version"], t["cuda"], t["git"]) == (torch.__version__, torch.version.cuda,
                                                   torch.version.git_version)
    assert t["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert t["blas"] and t["blas"] in torch.__config__.show()
    assert env["cpu"]["model"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert env["cpu"]["logical_cpus"] == os.cpu_count()
    assert env["threads"]["torch"] == torch.get_num_threads()
    assert envmod.environment(tmp_path / "absent")["cpu"]["model"] is None
