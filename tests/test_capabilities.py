"""The capability module and its test-only profile override (fast, no Paddle runs)."""
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import capabilities as caps
from pipeline import env
from pipeline.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def test_real_host_is_reported_without_a_profile(monkeypatch):
    monkeypatch.delenv(caps.PROFILE_ENV, raising=False)
    assert caps.profile() == [] and caps.cpu_flags() == caps.real_cpu_flags()
    assert not caps.simulated(caps.BF16_FLAGS | caps.VNNI_FLAGS)
    assert caps.host_arch() in ("x86", "arm") or caps.host_arch()
    assert env.cpu_flags() == set(caps.cpu_flags())           # one source of truth
    assert caps.describe()["profile"] is None


@pytest.mark.parametrize("name, bf16, vnni", [
    ("bf16", True, None), ("no-bf16", False, None), ("vnni", None, True), ("no-vnni", None, False),
    ("avx2", False, False), ("bf16,vnni", True, True), ("avx2,bf16", True, False),
])
def test_profiles_change_only_what_they_name(monkeypatch, name, bf16, vnni):
    monkeypatch.delenv(caps.PROFILE_ENV, raising=False)
    real_bf16, real_vnni = caps.has_bf16(), caps.has_vnni()
    monkeypatch.setenv(caps.PROFILE_ENV, name)
    assert caps.has_bf16() == (real_bf16 if bf16 is None else bf16)
    assert caps.has_vnni() == (real_vnni if vnni is None else vnni)
    assert caps.simulated(caps.BF16_FLAGS) == (caps.has_bf16() != real_bf16)
    assert caps.describe()["profile"] == name.split(",")


def test_no_gpu_profile_and_unknown_profile(monkeypatch):
    monkeypatch.setenv(caps.PROFILE_ENV, "no-gpu")
    assert caps.gpu()["gpu"] is False and env.capabilities()["gpu"] is False
    monkeypatch.setenv(caps.PROFILE_ENV, "bf16,avx-9000")
    with pytest.raises(ConfigError, match="avx-9000"):
        caps.cpu_flags()


def test_simulated_bf16_is_allowed_to_run_but_says_so(monkeypatch):
    monkeypatch.setenv(caps.PROFILE_ENV, "bf16")
    ok, why = caps.bf16_cpu_status()
    if caps.simulated(caps.BF16_FLAGS):
        assert ok and "simulated" in why and "evidence" in why
    monkeypatch.setenv(caps.PROFILE_ENV, "no-bf16")
    assert caps.bf16_cpu_status()[0] is False


def test_profile_reaches_child_processes():
    out = subprocess.run([sys.executable, "-c", "import pipeline.capabilities as c; print(c.has_bf16(), c.profile())"],
                         cwd=ROOT, capture_output=True, text=True, env={**__import__("os").environ,
                                                                        caps.PROFILE_ENV: "bf16"}, timeout=60)
    assert out.stdout.split()[0] == "True" and "bf16" in out.stdout
