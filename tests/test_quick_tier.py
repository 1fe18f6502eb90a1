"""The quick tier (`bash scripts/bootstrap.sh quick`, the tests not marked slow) keeps at least one test
of every package, so the edit loop never runs blind on one of them.

Reads the tests this run collected when it collected the whole suite (the full run and the quick run
do); otherwise collects the quick tier in a subprocess.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PACKAGES = ("kv", "scheduler", "runner", "models", "server", "router", "spec_decode", "sharding",
            "checkpoints", "bench")


def package_of(nodeid: str) -> str:
    parts = nodeid.split("::", 1)[0].split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else ""


def missing_packages(quick_nodeids: list[str]) -> list[str]:
    covered = {package_of(nodeid) for nodeid in quick_nodeids}
    return [package for package in PACKAGES if package not in covered]


def _collected_the_whole_suite(session) -> bool:
    config = session.config
    whole = {TESTS, TESTS.parent}
    return (not config.option.keyword and config.option.markexpr in ("", "not slow")
            and all(Path(arg.split("::")[0]).resolve() in whole for arg in config.args))


def _quick_tier_collected_apart() -> list[str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow",
                           "-p", "no:cacheprovider", str(TESTS)],
                          cwd=TESTS.parent, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_the_quick_tier_has_a_test_of_every_package(request):
    session = request.session
    if _collected_the_whole_suite(session):
        quick = [item.nodeid for item in session.items if item.get_closest_marker("slow") is None]
    else:
        quick = _quick_tier_collected_apart()
    assert len(quick) > len(PACKAGES)
    assert missing_packages(quick) == [], "packages without a test outside @pytest.mark.slow"


def test_a_package_left_with_only_slow_tests_is_reported():
    quick = [f"tests/{package}/test_x.py::test_y" for package in PACKAGES if package != "router"]
    assert missing_packages(quick + ["tests/test_engine.py::test_z"]) == ["router"]
