"""docs/grafana/agentjax.json: a well-formed Grafana dashboard whose every query names metrics the
server or the router exports, covering what an operator watches."""
from __future__ import annotations

import json
import re
import sys

from tests.docs.pages import DOCS, REPO

sys.path.insert(0, str(REPO / "scripts"))
import gen_docs_reference  # noqa: E402

DASHBOARD = DOCS / "grafana" / "agentjax.json"


def queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    found = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    found += [variable["definition"] for variable in dashboard["templating"]["list"] if "definition" in variable]
    return found


def test_every_metric_the_dashboard_names_is_exported():
    metrics = gen_docs_reference.exported_metrics()
    exported = {metric["name"]: metric["type"] for source in metrics.values() for metric in source}
    named = {name for query in queries() for name in re.findall(r"agentjax:[a-z0-9_]+", query)}
    assert named
    for name in named:
        stem = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in exported or exported.get(stem) == "histogram", f"the dashboard queries {name}"


def test_the_dashboard_covers_kv_tiers_latency_speculation_and_queues():
    named = " ".join(queries())
    for needed in ("agentjax:kv_cached_blocks", "agentjax:kv_cache_usage_perc", "agentjax:kv_offload_tier_pages",
                   "agentjax:prefix_cache_hits_total", "agentjax:kv_offload_pages_loaded_total",
                   "agentjax:time_to_first_token_seconds_bucket", "agentjax:inter_token_latency_seconds_bucket",
                   "agentjax:spec_decode_num_accepted_tokens_total", "agentjax:num_requests_waiting"):
        assert needed in named, needed


def test_the_dashboard_is_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}" and panel["title"] and panel["description"]
        assert 0 <= panel["gridPos"]["x"] and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        refs = [target["refId"] for target in panel["targets"]]
        assert refs and len(refs) == len(set(refs))
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
    assert {variable["name"] for variable in dashboard["templating"]["list"]} == {"datasource", "instance"}
