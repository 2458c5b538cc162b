"""The frontend's log configuration (embedserve/scripts/log4j2.xml) against the one in the installed
TorchServe's jar: the same files, and the lines it drops are lines that TorchServe writes."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import pytest

import ts
from embedserve.archive.ts_config import update_properties
from embedserve.scripts.serverctl import LOG_CONFIG, LOG_CONFIG_VMARG, TorchServe

JAR = Path(ts.__file__).parent / "frontend" / "model-server.jar"


@pytest.fixture(scope="module")
def jar():
    with zipfile.ZipFile(JAR) as archive:
        yield archive


def appenders(root: ET.Element) -> dict[str, dict]:
    """Each appender's file, rollover pattern and line layout, by name."""
    return {a.get("name"): {"file": a.get("fileName"), "pattern": a.get("filePattern"),
                            "layout": a.find("PatternLayout").get("pattern")} for a in root.find("Appenders")}


def loggers(root: ET.Element) -> dict[str, ET.Element]:
    return {logger.get("name", "(root)"): logger for logger in root.find("Loggers")}


def test_the_same_files_and_loggers_as_torchserve_s_own(jar):
    theirs, ours = ET.fromstring(jar.read("log4j2.xml")), ET.parse(LOG_CONFIG).getroot()
    assert appenders(ours) == appenders(theirs)
    assert loggers(ours).keys() == loggers(theirs).keys()


def test_every_line_goes_to_each_of_its_files_once():
    named = loggers(ET.parse(LOG_CONFIG).getroot())
    root_refs = {ref.get("ref") for ref in named["(root)"].iter("AppenderRef")}
    for name, logger in named.items():
        refs = [ref.get("ref") for ref in logger.iter("AppenderRef")]
        if name != "(root)" and logger.get("additivity", "true") == "true":
            refs += root_refs
        assert len(refs) == len(set(refs)), name
    assert [ref.get("ref") for ref in named["ACCESS_LOG"].iter("AppenderRef")] == ["access_log"]
    assert named["ACCESS_LOG"].get("additivity") == "false"


def test_the_lines_it_drops_are_torchserve_s_lines_a_batch(jar):
    """Matched on the unformatted message: each one must be a format string in TorchServe's classes,
    or a newer TorchServe's reworded line would pass the filter unnoticed."""
    logger = loggers(ET.parse(LOG_CONFIG).getroot())["org.pytorch.serve"]
    (regex_filter,) = logger.iter("RegexFilter")
    assert (regex_filter.get("useRawMsg"), regex_filter.get("onMatch")) == ("true", "DENY")
    regex = regex_filter.get("regex")
    dropped = [alternative.replace("\\{\\}", "{}") for alternative in regex.removeprefix("^(").removesuffix(")$").split("|")]
    assert len(dropped) == 4
    classes = b"".join(jar.read(name) for name in jar.namelist() if name.startswith("org/pytorch/serve/wlm/"))
    for message in dropped:
        assert message.encode() in classes, message
        assert re.fullmatch(regex, message)
    assert not re.fullmatch(regex, "Backend response time: {} ms")  # not a prefix match


def server(tmp_path: Path, **properties: str) -> TorchServe:
    config = tmp_path / "config.properties"
    config.write_text("")
    update_properties(config, {"inference_address": "http://127.0.0.1:1", **properties})
    return TorchServe(config, tmp_path)


def test_serverctl_starts_torchserve_with_it_unless_vmargs_names_another(tmp_path):
    assert server(tmp_path).log_config_arguments() == ["--log-config", str(LOG_CONFIG)]
    assert server(tmp_path, vmargs="-Xmx2g").log_config_arguments() == ["--log-config", str(LOG_CONFIG)]
    own = f"-Xmx2g {LOG_CONFIG_VMARG}file:///etc/mine.xml"
    assert server(tmp_path, vmargs=own).log_config_arguments() == []


def test_the_benchmark_s_third_configuration_differs_only_in_the_access_log(tmp_path):
    from bench.frontend_logging import without_access_log

    ours, quiet = ET.parse(LOG_CONFIG).getroot(), ET.parse(without_access_log(tmp_path)).getroot()
    assert appenders(quiet) == appenders(ours)
    assert loggers(quiet)["ACCESS_LOG"].get("level") == "off"
    assert {name for name, logger in loggers(quiet).items() if logger.get("level") != loggers(ours)[name].get("level")} \
        == {"ACCESS_LOG"}
