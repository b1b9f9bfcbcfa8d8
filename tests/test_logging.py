"""PopART logging (user guide 4.6, 9.1): modules, levels, env vars, line format."""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

import popart.logging as plog
from popart.errors import popart_exception

SRC = os.path.dirname(os.path.dirname(os.path.abspath(plog.__file__)))
LINE = re.compile(r"^\[\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\.\d{3}\] \[popart:(\w+)\] \[(\w+)\] (.*)$")


@pytest.fixture
def logger():
    yield plog.getLogger()
    plog.getLogger().setLevel("OFF")


def _run(code, **env):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("POPART_LOG")}
    environ.update(env, PYTHONPATH=SRC)
    script = "import popart.logging as L\n" + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], env=environ, capture_output=True,
                          text=True, timeout=120)


def _lines(text):
    return [LINE.match(line).groups() for line in text.splitlines() if line]


def test_modules_and_levels():
    assert plog.MODULES == ("popart", "session", "ir", "devicex", "transform", "pattern",
                            "builder", "op", "opx", "ces", "python", "none")
    assert list(plog.LEVELS) == ["TRACE", "DEBUG", "INFO", "WARN", "ERR", "CRITICAL", "OFF"]


def test_default_is_off(capsys):
    out = _run("L.getLogger('session').critical('hidden'); print(L.getLogger().getLevel())")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "OFF" and out.stderr == ""


def test_set_level_on_popart_sets_every_module(logger, capsys):
    logger.setLevel("DEBUG")
    assert all(plog.getLogger(m).getLevel() == "DEBUG" for m in plog.MODULES)
    plog.getLogger("session").setLevel("OFF")
    assert plog.getLogger("session").getLevel() == "OFF"
    assert plog.getLogger("devicex").getLevel() == "DEBUG"
    plog.getLogger("devicex").debug("Creating poplar::Tensor {}", 1)
    plog.getLogger("session").info("not shown")
    logger.trace("below DEBUG: not shown")
    logger.warn("careful")
    err = capsys.readouterr().err
    assert _lines(err) == [("devicex", "debug", "Creating poplar::Tensor 1"),
                           ("popart", "warning", "careful")]


def test_level_threshold_per_method(logger, capsys):
    logger.setLevel("WARN")
    for method in ("trace", "debug", "info", "warn", "warning", "error", "critical"):
        getattr(plog.getLogger("ir"), method)(method)
    assert [m for _, _, m in _lines(capsys.readouterr().err)] == \
        ["warn", "warning", "error", "critical"]
    assert plog.getLogger("ir").isEnabledFor("ERR")
    assert not plog.getLogger("ir").isEnabledFor("INFO")


def test_trace_level_prints_everything(logger, capsys):
    logger.setLevel("TRACE")
    plog.getLogger("ces").trace("t")
    plog.getLogger("ces").error("e")
    assert _lines(capsys.readouterr().err) == [("ces", "trace", "t"), ("ces", "error", "e")]


def test_bad_names_raise():
    with pytest.raises(popart_exception, match="'LOUD'"):
        plog.getLogger().setLevel("LOUD")
    with pytest.raises(popart_exception, match="'sessions'"):
        plog.getLogger("sessions")


def test_env_level_and_stdout_destination():
    out = _run("""
        L.getLogger('builder').info('hello')
        L.getLogger('builder').debug('too detailed')
        print(L.getLogger('op').getLevel())
    """, POPART_LOG_LEVEL="INFO", POPART_LOG_DEST="stdout")
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    assert LINE.match(first).groups() == ("builder", "info", "hello")
    assert second == "INFO" and out.stderr == ""


def test_env_default_destination_is_stderr():
    out = _run("L.getLogger('ir').warn('w')", POPART_LOG_LEVEL="WARN")
    assert out.stdout == "" and _lines(out.stderr) == [("ir", "warning", "w")]


def test_env_file_destination(tmp_path):
    path = tmp_path / "log.txt"
    out = _run("L.getLogger('opx').error('to file')", POPART_LOG_LEVEL="DEBUG",
               POPART_LOG_DEST=str(path))
    assert out.returncode == 0, out.stderr
    assert out.stderr == "" and _lines(path.read_text()) == [("opx", "error", "to file")]


def test_env_config_overrides_level(tmp_path):
    conf = tmp_path / "conf.py"
    conf.write_text(json.dumps({"devicex": "INFO", "session": "WARN"}))
    out = _run("""
        for m in ('devicex', 'session', 'ir'):
            L.getLogger(m).info(m)
            L.getLogger(m).warn(m)
        print(L.getLogger('devicex').getLevel(), L.getLogger('ir').getLevel())
    """, POPART_LOG_LEVEL="ERR", POPART_LOG_CONFIG=str(conf), POPART_LOG_DEST="stderr")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["INFO", "ERR"]
    assert _lines(out.stderr) == [("devicex", "info", "devicex"),
                                  ("devicex", "warning", "devicex"),
                                  ("session", "warning", "session")]


def test_env_bad_values_raise(tmp_path):
    out = _run("L.getLogger()", POPART_LOG_LEVEL="LOUD")
    assert out.returncode != 0 and "POPART_LOG_LEVEL" in out.stderr and "LOUD" in out.stderr
    conf = tmp_path / "bad.json"
    conf.write_text(json.dumps({"nosuchmodule": "INFO"}))
    out = _run("L.getLogger()", POPART_LOG_CONFIG=str(conf))
    assert out.returncode != 0 and "nosuchmodule" in out.stderr
