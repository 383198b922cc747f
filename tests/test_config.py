"""LaunchConfig and parse_args: precedence, spellings, pass-through, derived parsers, YAML keys."""

from __future__ import annotations

import dataclasses
import os
import signal
import stat
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from launcher import UsageError
from launcher.cli import _build_command, parse_args
from launcher.config import (
    FIELDS,
    RECOVERY,
    TORCHRUN,
    LaunchConfig,
    StreamMode,
    env_var,
    load_config_file,
)

REPO = Path(__file__).resolve().parent.parent

# A valid value for every field, different from its default wherever the type allows.
VALID = {
    "nnodes": "1:4",
    "nproc_per_node": "2",
    "standalone": True,
    "rdzv_backend": "c10d",
    "rdzv_endpoint": "localhost:29400",
    "rdzv_id": "job42",
    "rdzv_conf": "timeout=900",
    "node_rank": 1,
    "master_addr": "10.0.0.1",
    "master_port": 29500,
    "local_addr": "10.0.0.2",
    "max_restarts": 5,
    "monitor_interval": 0.5,
    "start_method": "fork",
    "role": "trainer",
    "module": True,
    "no_python": True,
    "run_path": True,
    "log_dir": "/tmp/ftlaunch-test-logs",
    "redirects": "3",
    "tee": "0:1,1:2",
    "local_ranks_filter": "0",
    "signals_to_handle": "SIGTERM,SIGUSR1",
    "restart_policy": "cold",
    "max_stalled_recoveries": 5,
    "no_warm_pool": True,
    "preload": "torch,numpy",
    "hang_timeout": 30.0,
    "hang_timeout_factor": 4.0,
    "startup_timeout": 120.0,
    "health_interval": 2.5,
    "gpu_release_timeout": 4.0,
    "section_timeouts": "step=10,checkpoint=600",
    "stack_dump": "faulthandler",
    "restart_backoff": 2.5,
    "restart_backoff_max": 10.0,
    "healthy_interval": 7.0,
    "grace_period": 5.0,
    "stop_timeout": 1.5,
    "ckpt_replicas": 2,
    "replica_bandwidth": 500.0,
    "exit_barrier_timeout": 100.0,
    "node_timeout": 3.0,
    "heartbeat_interval": 0.25,
    "intakes": 4,
    "secret_file": "/tmp/ftlaunch-secret",
    "metrics_port": 9400,
    "config": None,  # filled per test with a real file
    "dry_run": True,
}
YAML_FIELDS = [name for name in FIELDS if name != "config"]

CONSOLE = StreamMode(file=False, console=True)
FILE_ONLY = StreamMode(file=True, console=False)
BOTH = StreamMode(file=True, console=True)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith(("PET_", "FTLAUNCH_")):
            monkeypatch.delenv(key)


@pytest.fixture
def script(tmp_path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)  # also valid for --no-python
    return str(path)


def write_yaml(tmp_path: Path, data, name: str = "cfg.yaml") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(path)


def test_valid_table_covers_every_field():
    assert set(VALID) == set(FIELDS)


# --- precedence: CLI > env > YAML > default ----------------------------------------------


def test_default_when_nothing_given(script):
    config, got_script, args = parse_args([script])
    assert config == LaunchConfig()
    assert config.nproc_per_node == "1" and config.grace_period == 60.0
    assert got_script == script and args == []


def test_yaml_overrides_default(tmp_path, script):
    cfg = write_yaml(tmp_path, {"nproc_per_node": 4, "grace_period": 10})
    config, _, _ = parse_args(["--config", cfg, script])
    assert config.nproc_per_node == "4"
    assert config.grace_period == 10.0 and isinstance(config.grace_period, float)


def test_env_overrides_yaml(tmp_path, script, monkeypatch):
    cfg = write_yaml(tmp_path, {"nproc_per_node": 4, "grace_period": 10})
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    monkeypatch.setenv("FTLAUNCH_GRACE_PERIOD", "20")
    config, _, _ = parse_args(["--config", cfg, script])
    assert config.nproc_per_node == "3"
    assert config.grace_period == 20.0


def test_cli_overrides_env_and_yaml(tmp_path, script, monkeypatch):
    cfg = write_yaml(tmp_path, {"nproc_per_node": 4, "grace_period": 10})
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    monkeypatch.setenv("FTLAUNCH_GRACE_PERIOD", "20")
    config, _, _ = parse_args(["--config", cfg, "--nproc-per-node", "2", "--grace-period", "30",
                               script])
    assert config.nproc_per_node == "2"
    assert config.grace_period == 30.0


def test_env_alone_overrides_default(script, monkeypatch):
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    monkeypatch.setenv("FTLAUNCH_GRACE_PERIOD", "20")
    config, _, _ = parse_args([script])
    assert (config.nproc_per_node, config.grace_period) == ("3", 20.0)


def test_cli_value_equal_to_default_still_beats_yaml(tmp_path, script):
    cfg = write_yaml(tmp_path, {"max_restarts": 7})
    config, _, _ = parse_args(["--config", cfg, "--max-restarts", "3", script])
    assert config.max_restarts == 3


def test_yaml_keeps_fields_it_does_not_set_at_default(tmp_path, script):
    cfg = write_yaml(tmp_path, {"max_restarts": 7})
    config, _, _ = parse_args(["--config", cfg, script])
    assert config == dataclasses.replace(LaunchConfig(), max_restarts=7, config=cfg)


def test_config_path_from_env(tmp_path, script, monkeypatch):
    monkeypatch.setenv("FTLAUNCH_CONFIG", write_yaml(tmp_path, {"max_restarts": 7}))
    config, _, _ = parse_args([script])
    assert config.max_restarts == 7


def test_bool_flag_from_env_and_yaml(tmp_path, monkeypatch):
    monkeypatch.setenv("PET_MODULE", "1")
    config, script, _ = parse_args(["pkg.train"])
    assert config.module is True and script == "pkg.train"
    monkeypatch.delenv("PET_MODULE")
    config, _, _ = parse_args(["--config", write_yaml(tmp_path, {"module": True}), "pkg.train"])
    assert config.module is True


def test_env_var_names():
    assert env_var("nproc_per_node") == "PET_NPROC_PER_NODE"
    assert env_var("max_restarts") == "PET_MAX_RESTARTS"
    assert env_var("grace_period") == "FTLAUNCH_GRACE_PERIOD"
    assert env_var("config") == "FTLAUNCH_CONFIG"
    for name, f in FIELDS.items():
        prefix = "PET_" if f.metadata["group"] == TORCHRUN else "FTLAUNCH_"
        assert env_var(name) == prefix + name.upper()


# --- spellings, short flags, pass-through -------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["--nproc-per-node", "2"],
    ["--nproc_per_node", "2"],
    ["--nproc-per-node=2"],
    ["--nproc_per_node=2"],
])
def test_dashed_and_underscored_spellings(argv, script):
    config, _, _ = parse_args([*argv, script])
    assert config.nproc_per_node == "2"


def test_module_short_flag():
    config, script, args = parse_args(["-m", "pkg.train", "--lr", "1"])
    assert config.module is True
    assert script == "pkg.train" and args == ["--lr", "1"]


def test_redirects_short_flag(script):
    config, _, _ = parse_args(["-r", "3", script])
    assert config.redirects == "3"
    assert config.stream_modes(2) == {r: (FILE_ONLY, FILE_ONLY) for r in (0, 1)}


def test_tee_short_flag(script):
    config, _, _ = parse_args(["-t", "0:1,1:2", script])
    assert config.tee == "0:1,1:2"
    assert config.stream_modes(3) == {0: (BOTH, CONSOLE), 1: (CONSOLE, BOTH),
                                      2: (CONSOLE, CONSOLE)}


def test_script_args_pass_through_untouched(script):
    argv = ["--max-restarts", "9", "-m", "--help", "--config", "x.yaml", "--", "positional"]
    config, got_script, args = parse_args(["--nproc-per-node", "2", script, *argv])
    assert got_script == script
    assert args == argv
    assert config.max_restarts == LaunchConfig().max_restarts
    assert config.module is False and config.config is None
    assert config.nproc_per_node == "2"


# --- every field is a CLI option and a YAML key -------------------------------------------


def _cli_tokens(name: str, value) -> list[str]:
    flag = f"--{name.replace('_', '-')}"
    if isinstance(value, bool):
        return [flag]
    return [flag, str(value)]


def _value_for(name: str, tmp_path: Path):
    return write_yaml(tmp_path, "", "empty.yaml") if name == "config" else VALID[name]


def test_help_lists_every_field_with_both_spellings_and_env_var():
    result = CliRunner().invoke(_build_command(), ["--help"], terminal_width=200)
    assert result.exit_code == 0
    text = " ".join(result.output.split())  # undo click's wrapping
    for name in FIELDS:
        assert f"--{name.replace('_', '-')}" in text, name
        if "_" in name:
            assert f"--{name}" in text, name
        assert env_var(name) in text, name
    assert "Torchrun-compatible options:" in result.output
    assert "Fault tolerance:" in result.output


def test_command_has_one_option_per_field():
    command = _build_command()
    options = {p.name for p in command.params if p.param_type_name == "option"}
    assert FIELDS.keys() <= options
    for name in FIELDS:
        param = next(p for p in command.params if p.name == name)
        assert param.envvar == env_var(name)
        assert param.group == FIELDS[name].metadata["group"]


@pytest.mark.parametrize("name", list(FIELDS))
def test_every_field_settable_on_command_line(name, tmp_path, script):
    value = _value_for(name, tmp_path)
    argv = _cli_tokens(name, value)  # the script is executable, so --no-python accepts it
    config, _, _ = parse_args([*argv, script])
    assert getattr(config, name) == value
    others = {n: getattr(config, n) for n in FIELDS if n != name}
    assert others == {n: getattr(LaunchConfig(), n) for n in FIELDS if n != name}


@pytest.mark.parametrize("spelling", ["underscored", "dashed"])
@pytest.mark.parametrize("name", YAML_FIELDS)
def test_every_field_is_a_yaml_key(name, spelling, tmp_path, script):
    key = name if spelling == "underscored" else name.replace("_", "-")
    cfg = write_yaml(tmp_path, {key: VALID[name]})
    assert load_config_file(cfg) == {name: VALID[name]}
    config, _, _ = parse_args(["--config", cfg, script])
    assert getattr(config, name) == VALID[name]


def test_yaml_with_every_key_builds_a_valid_config(tmp_path, script):
    data = {name: VALID[name] for name in YAML_FIELDS if name != "no_python"}  # -m excludes it
    cfg = write_yaml(tmp_path, data)
    config, got_script, _ = parse_args(["--config", cfg, "pkg.train"])
    assert got_script == "pkg.train"
    assert {name: getattr(config, name) for name in data} == data


def test_yaml_nested_config_key_is_rejected(tmp_path):
    with pytest.raises(UsageError, match="'config' cannot name another file"):
        load_config_file(write_yaml(tmp_path, {"config": "other.yaml"}))


def test_yaml_nested_config_key_message_does_not_suggest_itself(tmp_path):
    with pytest.raises(UsageError) as info:
        load_config_file(write_yaml(tmp_path, {"config": "other.yaml"}))
    assert "did you mean 'config'" not in str(info.value)


def test_yaml_type_coercion(tmp_path):
    cfg = write_yaml(tmp_path, "nproc_per_node: 4\nnnodes: 2\nrestart_backoff: 3\n"
                               "local_addr: null\nstandalone: true\n")
    assert load_config_file(cfg) == {"nproc_per_node": "4", "nnodes": "2", "restart_backoff": 3.0,
                                     "local_addr": None, "standalone": True}


@pytest.mark.parametrize("text, key", [
    ("max_restarts: many\n", "max_restarts"),
    ("max_restarts: 2.5\n", "max_restarts"),
    ("max_restarts: true\n", "max_restarts"),
    ("grace_period: fast\n", "grace_period"),
    ("grace_period: false\n", "grace_period"),
    ("standalone: 'yes'\n", "standalone"),
    ("standalone: 1\n", "standalone"),
    ("nproc_per_node: [1, 2]\n", "nproc_per_node"),
    ("nproc_per_node: true\n", "nproc_per_node"),
    ("role: null\n", "role"),
])
def test_yaml_wrong_types_rejected(text, key, tmp_path):
    with pytest.raises(UsageError, match=key):
        load_config_file(write_yaml(tmp_path, text))


def test_yaml_unknown_key_suggests_close_match(tmp_path):
    with pytest.raises(UsageError, match="did you mean 'max_restarts'"):
        load_config_file(write_yaml(tmp_path, {"max_restart": 2}))


@pytest.mark.parametrize("text", ["", "# only a comment\n"])
def test_yaml_empty_file_is_no_settings(text, tmp_path):
    assert load_config_file(write_yaml(tmp_path, text)) == {}


def test_yaml_top_level_must_be_mapping(tmp_path):
    with pytest.raises(UsageError, match="mapping"):
        load_config_file(write_yaml(tmp_path, "- nnodes\n- 2\n"))


def test_yaml_bad_choice_rejected_by_validate(tmp_path, script):
    with pytest.raises(UsageError, match="rdzv-backend"):
        parse_args(["--config", write_yaml(tmp_path, {"rdzv_backend": "zookeeper"}), script])


@pytest.mark.parametrize("key, value", [("nnodes", "1:4"), ("tee", "1:2")])
def test_yaml_colon_values_stay_strings(key, value, tmp_path):
    assert load_config_file(write_yaml(tmp_path, f"{key}: {value}\n")) == {key: value}


EXAMPLES = sorted((REPO / "configs").glob("*.y*ml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_configs_load(path):
    values = load_config_file(str(path))
    assert set(values) <= set(FIELDS)
    LaunchConfig(**values).validate()


# --- derived parsers ----------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("2", (2, 2)), ("1:4", (1, 4)), (" 3 ", (3, 3)), ("2:2", (2, 2)), ("1:1", (1, 1)),
])
def test_node_range(text, expected):
    assert LaunchConfig(nnodes=text).node_range() == expected


@pytest.mark.parametrize("text", ["0", "4:1", "abc", "1:", ":2", "-1", "0:2", "1:x", ""])
def test_node_range_rejects(text):
    with pytest.raises(UsageError, match="--nnodes"):
        LaunchConfig(nnodes=text).node_range()


def test_local_world_size():
    assert LaunchConfig(nproc_per_node="4").local_world_size() == 4
    assert LaunchConfig(nproc_per_node="cpu").local_world_size() == (os.cpu_count() or 1)
    assert LaunchConfig(nproc_per_node="gpu").local_world_size(gpu_count=2) == 2
    assert LaunchConfig(nproc_per_node="auto").local_world_size(gpu_count=3) == 3
    assert LaunchConfig(nproc_per_node="auto").local_world_size(gpu_count=0) == (os.cpu_count() or 1)
    with pytest.raises(UsageError, match="no GPU"):
        LaunchConfig(nproc_per_node="gpu").local_world_size(gpu_count=0)


@pytest.mark.parametrize("text", ["0", "-1", "x", "1.5", ""])
def test_local_world_size_rejects(text):
    with pytest.raises(UsageError, match="--nproc-per-node"):
        LaunchConfig(nproc_per_node=text).local_world_size(gpu_count=0)


@pytest.mark.parametrize("redirects, tee, expected", [
    ("0", "0", {0: (CONSOLE, CONSOLE), 1: (CONSOLE, CONSOLE)}),
    ("1", "0", {0: (FILE_ONLY, CONSOLE), 1: (FILE_ONLY, CONSOLE)}),
    ("2", "0", {0: (CONSOLE, FILE_ONLY), 1: (CONSOLE, FILE_ONLY)}),
    ("3", "0", {0: (FILE_ONLY, FILE_ONLY), 1: (FILE_ONLY, FILE_ONLY)}),
    ("0", "3", {0: (BOTH, BOTH), 1: (BOTH, BOTH)}),
    ("0:3", "0", {0: (FILE_ONLY, FILE_ONLY), 1: (CONSOLE, CONSOLE)}),
    ("0", "1:1", {0: (CONSOLE, CONSOLE), 1: (BOTH, CONSOLE)}),
    (" 1:2 , 0:1 ", "0", {0: (FILE_ONLY, CONSOLE), 1: (CONSOLE, FILE_ONLY)}),
    ("1", "2", {0: (FILE_ONLY, BOTH), 1: (FILE_ONLY, BOTH)}),  # torchrun: only stderr on console
    ("3", "3", {0: (BOTH, BOTH), 1: (BOTH, BOTH)}),  # tee wins over redirect
])
def test_stream_modes(redirects, tee, expected):
    assert LaunchConfig(redirects=redirects, tee=tee).stream_modes(2) == expected


@pytest.mark.parametrize("field", ["redirects", "tee"])
@pytest.mark.parametrize("spec", ["4", "x", "", "0:4", "a:1", "0:1,", "-1:1", "12"])
def test_stream_modes_rejects(field, spec):
    with pytest.raises(UsageError, match=f"--{field}"):
        LaunchConfig(**{field: spec}).stream_modes(2)


@pytest.mark.parametrize("argv", [["--redirects", "5"], ["--tee", "x"],
                                  ["--local-ranks-filter", "3"]])
def test_parse_args_rejects_bad_output_specs(argv, script):
    with pytest.raises(UsageError):
        parse_args([*argv, script])


def test_console_ranks():
    assert LaunchConfig().console_ranks(3) == {0, 1, 2}
    assert LaunchConfig(local_ranks_filter="  ").console_ranks(2) == {0, 1}
    assert LaunchConfig(local_ranks_filter="0,2").console_ranks(4) == {0, 2}
    assert LaunchConfig(local_ranks_filter=" 1 , 3,").console_ranks(4) == {1, 3}


@pytest.mark.parametrize("spec", ["4", "a", "-1", "0,x", "1.0"])
def test_console_ranks_rejects(spec):
    with pytest.raises(UsageError, match="--local-ranks-filter"):
        LaunchConfig(local_ranks_filter=spec).console_ranks(4)


def test_signals():
    assert LaunchConfig().signals() == [signal.SIGTERM, signal.SIGINT, signal.SIGHUP,
                                        signal.SIGQUIT]
    assert LaunchConfig(signals_to_handle=" SIGUSR1, TERM ,").signals() == [signal.SIGUSR1,
                                                                           signal.SIGTERM]
    assert LaunchConfig(signals_to_handle="").signals() == []


@pytest.mark.parametrize("spec, match", [
    ("SIGFOO", "unknown signal"), ("SIGTERM,bogus", "unknown signal"), ("9", "unknown signal"),
    ("SIGKILL", "SIGKILL cannot"), ("STOP", "SIGSTOP cannot"), ("SIGCHLD", "SIGCHLD cannot"),
])
def test_signals_rejects(spec, match):
    with pytest.raises(UsageError, match=match):
        LaunchConfig(signals_to_handle=spec).signals()


def test_rdzv_settings():
    assert LaunchConfig().rdzv_settings() == {}
    assert LaunchConfig(rdzv_conf="timeout=900, join_timeout = 60,").rdzv_settings() == {
        "timeout": "900", "join_timeout": "60"}
    assert LaunchConfig(rdzv_conf="a=b=c,empty=").rdzv_settings() == {"a": "b=c", "empty": ""}


@pytest.mark.parametrize("spec", ["timeout", "=5", "a=1,b", " = x"])
def test_rdzv_settings_rejects(spec):
    with pytest.raises(UsageError, match="--rdzv-conf"):
        LaunchConfig(rdzv_conf=spec).rdzv_settings()


# --- validate -----------------------------------------------------------------------------


def test_validate_accepts_defaults_and_auto():
    LaunchConfig().validate()
    LaunchConfig(nproc_per_node="auto").validate()


@pytest.mark.parametrize("changes, match", [
    ({"module": True, "no_python": True}, "--module and --no-python"),
    ({"max_restarts": -1}, "--max-restarts"),
    ({"node_rank": -1}, "--node-rank"),
    ({"master_port": -1}, "--master-port"),
    ({"master_port": 65536}, "--master-port"),
    ({"restart_backoff": -0.1}, "--restart-backoff"),
    ({"grace_period": -1.0}, "--grace-period"),
    ({"stop_timeout": -1.0}, "--stop-timeout"),
    ({"ckpt_replicas": -1}, "--ckpt-replicas"),
    ({"replica_bandwidth": -5.0}, "--replica-bandwidth"),
    ({"intakes": -1}, "--intakes"),
    ({"intakes": 256}, "--intakes"),
    ({"exit_barrier_timeout": -1.0}, "--exit-barrier-timeout"),
    ({"monitor_interval": -1.0}, "--monitor-interval"),
    ({"restart_policy": "warm"}, "--restart-policy"),
    ({"start_method": "thread"}, "--start-method"),
    ({"rdzv_conf": "bad"}, "--rdzv-conf"),
    ({"signals_to_handle": "SIGKILL"}, "--signals-to-handle"),
    ({"nnodes": "x"}, "--nnodes"),
    ({"nproc_per_node": "0"}, "--nproc-per-node"),
])
def test_validate_rejects(changes, match):
    with pytest.raises(UsageError, match=match):
        LaunchConfig(**changes).validate()


def test_validate_accepts_port_bounds():
    LaunchConfig(master_port=0).validate()
    LaunchConfig(master_port=65535).validate()


def test_groups_are_known():
    assert {f.metadata["group"] for f in FIELDS.values()} <= {TORCHRUN, RECOVERY, "ftlaunch"}
