import pytest

from pipeline.core.config import load_config, parse_override
from pipeline.core.errors import ConfigError


def test_defaults_and_task_config_load():
    cfg = load_config(["configs/chars.yaml"])
    assert cfg.task == "classification" and cfg.run.name == "chars"
    assert set(cfg.server.gates) >= set(cfg.server.precisions)


def test_overrides_are_typed():
    cfg = load_config(["configs/smoke.yaml"], ["train.epochs=5", "server.gates.fp16.atol=1e-12", "lite.arm=[fp32]"])
    assert cfg.train.epochs == 5 and cfg.server.gates["fp16"].atol == 1e-12 and cfg.lite.arm == ["fp32"]


@pytest.mark.parametrize("override, needle", [
    ("train.epoch=3", "did you mean 'epochs'"),
    ("trian.epochs=3", "did you mean 'train'"),
    ("train.lr=-1", "train.lr"),
    ("train.lr=abc", "train.lr"),
    ("train.epochs=0", "train.epochs"),
    ("train.amp.level=O3", "train.amp.level"),
    ("server.precisions=[fp64]", "server.precisions"),
    ("epochs", "key=value"),
])
def test_bad_overrides_name_the_key(override, needle):
    with pytest.raises(ConfigError) as exc:
        load_config([], [override])
    assert needle in exc.value.one_line()


def test_model_args_are_free_form():
    cfg = load_config([], ["model.args.hidden=64"])
    assert cfg.model.args == {"hidden": 64}


def test_unknown_key_in_file_and_missing_file(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("train:\n  batchsize: 3\n")
    with pytest.raises(ConfigError, match="did you mean 'batch_size'"):
        load_config([bad])
    with pytest.raises(ConfigError, match="not found"):
        load_config([tmp_path / "nope.yaml"])
    broken = tmp_path / "b.yaml"
    broken.write_text("train: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config([broken])


def test_fp32_row_is_required():
    with pytest.raises(ConfigError, match="fp32"):
        load_config([], ["server.precisions=[int8]"])


def test_parse_override_nests():
    assert parse_override("a.b.c=1.5") == {"a": {"b": {"c": 1.5}}}


def test_hash_changes_with_section():
    a = load_config([], ["train.epochs=2"])
    b = load_config([], ["train.epochs=3"])
    assert a.hash_of("train") != b.hash_of("train") and a.hash_of("export") == b.hash_of("export")
