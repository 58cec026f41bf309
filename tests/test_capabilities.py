"""The capability module and its test-only profile override (fast, no Paddle runs)."""
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core import capabilities as caps
from pipeline.core import env
from pipeline.core.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("machine, arch", [("x86_64", "x86"), ("AMD64", "x86"), ("aarch64", "arm"),
                                           ("arm64", "arm"), ("riscv64", "riscv64")])
def test_host_arch_names_the_lite_target_of_the_machine(monkeypatch, machine, arch):
    """x86/arm name the .nb target this host can execute; anything else is passed through (no target matches it)."""
    monkeypatch.setattr(caps.platform, "machine", lambda: machine)
    assert caps.host_arch() == arch


def test_real_host_is_reported_without_a_profile(monkeypatch):
    monkeypatch.delenv(caps.PROFILE_ENV, raising=False)
    assert caps.profile() == [] and caps.cpu_flags() == caps.real_cpu_flags()
    assert not caps.simulated(caps.BF16_FLAGS | caps.VNNI_FLAGS)
    assert env.cpu_flags() == set(caps.cpu_flags())           # one source of truth
    assert caps.describe()["profile"] is None


# Machines seen so far (and an arm board): the capability logic is tested against each of them, never
# against whatever CPU the test happens to run on (the AMX machine turned CI red when it was).
CPUINFO = Path(__file__).resolve().parent / "cpuinfo"
MACHINES = {  # file -> (bf16, vnni) as the real CPU reports them
    "amd_avx2": (False, False),
    "amd_avx512_bf16_vnni": (True, True),
    "intel_amx": (True, True),
    "arm_neoverse_n1": (False, False),
}
# what each profile does to (bf16, vnni), written independently of capabilities.PROFILES
EFFECT = {"avx2": lambda b, v: (False, False), "no-bf16": lambda b, v: (False, v), "bf16": lambda b, v: (True, v),
          "vnni": lambda b, v: (b, True), "no-vnni": lambda b, v: (b, False), "no-gpu": lambda b, v: (b, v)}
COMBOS = [(a,) for a in EFFECT] + [(a, b) for a in EFFECT for b in EFFECT if a != b]


@pytest.fixture(params=sorted(MACHINES))
def machine(request, monkeypatch):
    """Make capabilities read a synthetic /proc/cpuinfo of one of the machines seen so far."""
    monkeypatch.delenv(caps.PROFILE_ENV, raising=False)
    monkeypatch.setattr(caps, "CPUINFO", str(CPUINFO / request.param))
    return request.param


def test_each_machine_is_read_as_it_is(machine):
    bf16, vnni = MACHINES[machine]
    assert (caps.has_bf16(), caps.has_vnni()) == (bf16, vnni)
    assert caps.profile() == [] and not caps.simulated(caps.BF16_FLAGS | caps.VNNI_FLAGS)
    assert caps.describe()["avx512"] == machine.startswith(("amd_avx512", "intel"))
    assert ("amx_int8" in caps.cpu_flags()) == (machine == "intel_amx")


@pytest.mark.parametrize("combo", COMBOS, ids=",".join)
def test_profiles_change_only_what_they_name(machine, monkeypatch, combo):
    bf16, vnni = MACHINES[machine]
    for name in combo:
        bf16, vnni = EFFECT[name](bf16, vnni)
    real = caps.real_cpu_flags()
    monkeypatch.setenv(caps.PROFILE_ENV, ",".join(combo))
    flags = caps.cpu_flags()
    assert (caps.has_bf16(), caps.has_vnni()) == (bf16, vnni), sorted(flags)
    # "simulated" means: some of these flags are reported differently from the CPU (not: the verdict changed)
    for group in (caps.BF16_FLAGS, caps.VNNI_FLAGS):
        assert caps.simulated(group) == bool((flags ^ real) & group)
    if "avx2" in combo and combo[-1] == "avx2":
        assert not any(f.startswith(("avx512", "amx")) for f in flags)
    assert caps.describe()["profile"] == list(combo)


def test_no_gpu_profile_and_unknown_profile(monkeypatch):
    monkeypatch.setenv(caps.PROFILE_ENV, "no-gpu")
    assert caps.gpu()["gpu"] is False and env.capabilities()["gpu"] is False
    monkeypatch.setenv(caps.PROFILE_ENV, "bf16,avx-9000")
    with pytest.raises(ConfigError, match="avx-9000"):
        caps.cpu_flags()


def test_simulated_bf16_is_allowed_to_run_but_says_so(machine, monkeypatch):
    monkeypatch.setenv(caps.PROFILE_ENV, "bf16")
    ok, why = caps.bf16_cpu_status()
    if caps.simulated(caps.BF16_FLAGS):
        assert ok and "simulated" in why and "evidence" in why
    else:       # the machine has bf16 itself: Paddle's own check (on the real host) decides
        assert MACHINES[machine][0] and "bf16" in why
    monkeypatch.setenv(caps.PROFILE_ENV, "no-bf16")
    assert caps.bf16_cpu_status()[0] is False


def test_profile_reaches_child_processes():
    out = subprocess.run([sys.executable, "-c", "import pipeline.core.capabilities as c; print(c.has_bf16(), c.profile())"],
                         cwd=ROOT, capture_output=True, text=True, env={**__import__("os").environ,
                                                                        caps.PROFILE_ENV: "bf16"}, timeout=60)
    assert out.stdout.split()[0] == "True" and "bf16" in out.stdout
