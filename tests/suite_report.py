"""The suite report: per test and per file, wall and CPU time, XLA executables built, peak resident
memory and memory mappings; printed at the end of every run, optionally written as JSON, and the
run fails when a test process passes the memory bounds.

Works in one process and under pytest-xdist (each worker measures its own tests and sends the figures
with the tests' reports). It only measures: it never changes what a test does.
"""
from __future__ import annotations

import json
import os
import resource
import time
from collections import defaultdict
from pathlib import Path

import pytest

from tests.suite_probes import (
    CompileCounter, PeakWatcher, Sample, cpu_seconds, peak_resident_bytes, reset_peak_resident,
)

PROPERTY = "suite_report"
SESSION_TEARDOWN = "suite_report_session_teardown"
GB = 10**9
SHOWN = 20


def pytest_addoption(parser):
    group = parser.getgroup("suite report")
    # Give it as --suite-report=PATH: pytest reads a separate PATH that exists as a test path before
    # this plugin (registered by tests/conftest.py) is loaded.
    group.addoption("--suite-report", metavar="PATH", default=os.environ.get("AGENTJAX_SUITE_REPORT"),
                    help="write the per-test and per-file figures as JSON to PATH ($AGENTJAX_SUITE_REPORT); "
                         "PATH.jsonl gets each test's figures as it ends")
    group.addoption("--suite-max-rss-gb", type=float, default=8.0,
                    help="fail the run when a test process's peak resident size passes this (GB, default 8)")
    group.addoption("--suite-max-maps", type=int, default=30_000,
                    help="fail the run when a test process holds more memory mappings (default 30,000; Linux refuses past its default limit of 65,530)")


def pytest_configure(config):
    config.pluginmanager.register(SuiteReport(config), "agentjax-suite-report")


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


class SuiteReport:
    def __init__(self, config):
        self.config = config
        self.in_worker = hasattr(config, "workerinput")
        # from the config, not the environment: a pytest started by a test inherits its worker's variables
        self.worker = config.workerinput["workerid"] if self.in_worker else "main"
        self.counter = CompileCounter()
        self.watcher = PeakWatcher()
        self.records: list[dict] = []       # one per test, gathered where the reports are logged
        self.processes: dict[str, dict] = {}  # worker -> its whole-run figures
        self.process_peak = Sample()
        self._start: tuple | None = None
        self._before_last_teardown: tuple | None = None
        self.started_at = time.time()
        self.load_at_start = os.getloadavg()
        path = config.getoption("suite_report")
        self.live_path = f"{path}.jsonl" if path and not self.in_worker else None
        if self.live_path:
            Path(self.live_path).unlink(missing_ok=True)

    # -- measuring, in the process that runs the tests --

    def pytest_sessionstart(self, session):
        self.watcher.start()

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.counter.attach_if_jax_loaded()
        reset_peak_resident()
        self.watcher.take()
        self._start, self._before_last_teardown = self._snapshot(), None
        yield
        self._start = None

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_teardown(self, item, nextitem):
        """The last test of a process also tears down the session's fixtures (the README server,
        shared models): that cost goes to a record of its own, not to the test."""
        if nextitem is None and self._start is not None:
            self._before_last_teardown = self._measure(self._start), self._snapshot()
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if call.when != "teardown" or self._start is None:
            return
        if self._before_last_teardown is None:
            record = self._measure(self._start)
        else:
            record, teardown_start = self._before_last_teardown
            teardown = self._measure(teardown_start).as_dict() | {"worker": self.worker}
            report.user_properties.append((SESSION_TEARDOWN, teardown))
        report.user_properties.append((PROPERTY, record.as_dict() | {"worker": self.worker}))

    def _snapshot(self) -> tuple:
        return (time.perf_counter(), *cpu_seconds(), self.counter.totals(),
                resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)

    def _measure(self, start: tuple) -> Sample:
        """The costs since `start` (a `_snapshot()`)."""
        self.counter.attach_if_jax_loaded()  # a test module that imported jax only now
        wall0, cpu0, child0, compiles0, child_maxrss0 = start
        cpu, child = cpu_seconds()
        compiles = [now - before for now, before in zip(self.counter.totals(), compiles0)]
        maps, child_rss, child_maps = self.watcher.take()
        child_maxrss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        if child_maxrss > child_maxrss0:  # a child reaped since `start` reached this peak
            child_rss = max(child_rss, child_maxrss << 10)
        sample = Sample(time.perf_counter() - wall0, cpu - cpu0, child - child0, *compiles,
                        peak_resident_bytes(), maps, child_rss, child_maps)
        self.process_peak.add(Sample(peak_rss=sample.peak_rss, peak_maps=sample.peak_maps,
                                     child_peak_rss=sample.child_peak_rss,
                                     child_peak_maps=sample.child_peak_maps))
        return sample

    def _process_totals(self) -> dict:
        cpu, child = cpu_seconds()
        built, loads, compile_s, trace_s, lower_s = self.counter.totals()
        return Sample(time.time() - self.started_at, cpu, child, built, loads, compile_s, trace_s, lower_s,
                      self.process_peak.peak_rss, self.process_peak.peak_maps,
                      self.process_peak.child_peak_rss, self.process_peak.child_peak_maps).as_dict()

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session):
        self.watcher.stop()
        if self.in_worker:
            session.config.workeroutput[PROPERTY] = json.dumps(self._process_totals())
            return
        if not self.processes:  # one process ran every test (no pytest-xdist workers reported)
            self.processes[self.worker] = self._process_totals()
        self.finish(session)

    # -- gathering, in the process that logs the reports (the xdist controller, or the only process) --

    def pytest_runtest_logreport(self, report):
        if self.in_worker or report.when != "teardown":
            return
        for name, value in report.user_properties:
            if name in (PROPERTY, SESSION_TEARDOWN):
                nodeid = report.nodeid if name == PROPERTY else f"(session teardown)::{value['worker']}"
                record = {"nodeid": nodeid, **value}
                self.records.append(record)
                if self.live_path:
                    with open(self.live_path, "a") as live:
                        live.write(json.dumps(record) + "\n")

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error):
        totals = getattr(node, "workeroutput", {}).get(PROPERTY)
        if totals:
            self.processes[node.gateway.id] = json.loads(totals)

    def finish(self, session):
        self.finished_at = time.time()
        self.load_at_end = os.getloadavg()
        self.breaches = self.memory_breaches()
        if self.breaches and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        path = self.config.getoption("suite_report")
        if path:
            Path(path).write_text(json.dumps(self.as_json(), indent=1) + "\n")

    def files(self) -> dict[str, dict]:
        by_file: dict[str, Sample] = defaultdict(Sample)
        tests: dict[str, int] = defaultdict(int)
        workers: dict[str, set] = defaultdict(set)
        for record in self.records:
            path = file_of(record["nodeid"])
            by_file[path].add(Sample.from_dict(record))
            tests[path] += 1
            workers[path].add(record["worker"])
        return {path: sample.as_dict() | {"tests": tests[path], "workers": sorted(workers[path])}
                for path, sample in by_file.items()}

    def memory_breaches(self) -> list[str]:
        max_rss = self.config.getoption("suite_max_rss_gb") * GB
        max_maps = self.config.getoption("suite_max_maps")
        breaches = []
        for record in self.records:
            where = f"{record['nodeid']} ({record['worker']})"
            if record["peak_rss"] > max_rss:
                breaches.append(f"{where}: {record['peak_rss'] / GB:.2f} GB resident > {max_rss / GB:g} GB")
            if record["child_peak_rss"] > max_rss:
                breaches.append(f"{where}: a process it started reached {record['child_peak_rss'] / GB:.2f} GB "
                                f"resident > {max_rss / GB:g} GB")
            if max(record["peak_maps"], record["child_peak_maps"]) > max_maps:
                breaches.append(f"{where}: {max(record['peak_maps'], record['child_peak_maps'])} memory "
                                f"mappings > {max_maps}")
        return breaches

    def totals(self) -> dict:
        total = Sample()
        for record in self.records:
            total.add(Sample.from_dict(record))
        tests = sum(1 for record in self.records if not record["nodeid"].startswith("(session teardown)"))
        return total.as_dict() | {"tests": tests, "run_wall_s": self.finished_at - self.started_at,
                                  "load_at_start": self.load_at_start, "load_at_end": self.load_at_end,
                                  "cpus": os.cpu_count(), "started_at": self.started_at}

    def as_json(self) -> dict:
        return {"totals": self.totals(), "processes": self.processes, "files": self.files(),
                "tests": self.records, "memory_breaches": self.breaches,
                "bounds": {"max_rss_gb": self.config.getoption("suite_max_rss_gb"),
                           "max_maps": self.config.getoption("suite_max_maps")}}

    # -- printing --

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter):
        if self.in_worker or not hasattr(self, "breaches") or not self.records:
            return  # a worker, or a run that ran no test (--collect-only)
        write = terminalreporter.write_line
        terminalreporter.section("suite report")
        header = f"{'wall s':>8} {'cpu s':>8} {'child s':>7} {'built':>6} {'loads':>5} {'compile s':>9} " \
                 f"{'peak GB':>7} {'maps':>6}"

        def row(sample: dict) -> str:
            return (f"{sample['wall_s']:8.1f} {sample['cpu_s']:8.1f} {sample['child_cpu_s']:7.1f} "
                    f"{sample['compiles']:6d} {sample['cache_loads']:5d} {sample['compile_s']:9.1f} "
                    f"{sample['peak_rss'] / GB:7.2f} {sample['peak_maps']:6d}")

        files = self.files()
        write(f"slowest {SHOWN} files (of {len(files)}):")
        write(f"{header} {'tests':>5}  file")
        for path, sample in sorted(files.items(), key=lambda item: -item[1]["wall_s"])[:SHOWN]:
            write(f"{row(sample)} {sample['tests']:5d}  {path}")
        write(f"slowest {SHOWN} tests and session teardowns (of {len(self.records)}):")
        write(f"{header}  test")
        for record in sorted(self.records, key=lambda record: -record["wall_s"])[:SHOWN]:
            write(f"{row(record)}  {record['nodeid']}")
        totals = self.totals()
        write(f"totals over {totals['tests']} tests: {totals['wall_s']:.0f} s in tests, "
              f"{totals['cpu_s']:.0f} CPU s (+{totals['child_cpu_s']:.0f} in started processes), "
              f"{totals['compiles']} executables built ({totals['compile_s']:.0f} s compiling, "
              f"{totals['trace_s']:.0f} s tracing, {totals['lower_s']:.0f} s lowering), "
              f"{totals['cache_loads']} loaded from the compilation cache; run {totals['run_wall_s']:.0f} s, "
              f"load average {self.load_at_start[0]:.1f} at start and {self.load_at_end[0]:.1f} at the end")
        for worker, process in sorted(self.processes.items()):
            write(f"process {worker}: peak {process['peak_rss'] / GB:.2f} GB resident, {process['peak_maps']} "
                  f"memory mappings; processes it started: peak {process['child_peak_rss'] / GB:.2f} GB, "
                  f"{process['child_peak_maps']} mappings; {process['cpu_s']:.0f} CPU s")
        for breach in self.breaches:
            terminalreporter.write_line(f"MEMORY BOUND EXCEEDED: {breach}", red=True, bold=True)
