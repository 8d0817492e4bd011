"""Writes radixserve.json, the Grafana dashboard over radixserve's Prometheus metrics.

The panels are the live page's (/dashboard) minus the radix tree, which Prometheus cannot
hold. Conventions follow vLLM's dashboard: a `DS_PROMETHEUS` datasource input, timeseries
panels, `histogram_quantile` over `$__rate_interval` for latencies. Rerun after changing a
panel: `python deploy/grafana/make_dashboard.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("radixserve.json")
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
SEL = '{job=~"$job", instance=~"$instance"}'  # every expression filters by the variables
RATE = "[$__rate_interval]"


def rate(metric: str, window: str = RATE) -> str:
    return f"sum(rate({metric}{SEL}{window}))"


def quantile(q: float, histogram: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket{SEL}{RATE})))"


def latency_targets(histogram: str) -> list[tuple[str, str]]:
    return [("P50", quantile(0.5, histogram)), ("P99", quantile(0.99, histogram))]


# (title, description, unit, [(legend, expr)], stacked)
PANELS = [
    ("Requests", "Running batch and waiting queue.", "none", [
        ("running", f"sum(radixserve:num_requests_running{SEL})"),
        ("waiting", f"sum(radixserve:num_requests_waiting{SEL})"),
    ], False),
    ("KV pool pages", "Free, held by running requests, in the radix tree (in use / evictable).",
     "none", [
        ("held by requests", f"sum(radixserve:kv_pool_capacity_pages{SEL}) - "
                             f"sum(radixserve:kv_pool_free_pages{SEL}) - "
                             f"sum(radixserve:radix_tree_pages{SEL})"),
        ("tree, in use", f"sum(radixserve:radix_tree_locked_pages{SEL})"),
        ("tree, evictable", f"sum(radixserve:radix_tree_pages{SEL}) - "
                            f"sum(radixserve:radix_tree_locked_pages{SEL})"),
        ("free", f"sum(radixserve:kv_pool_free_pages{SEL})"),
    ], True),
    ("Cache hit rate", "Prompt tokens served from the radix cache.", "percentunit", [
        ("last minute", f"{rate('radixserve:cached_tokens_total', '[1m]')} / "
                        f"{rate('radixserve:prompt_tokens_total', '[1m]')}"),
        ("since start", f"avg(radixserve:cache_hit_rate{SEL})"),
    ], False),
    ("Prefill: computed vs served from cache", "Prompt tokens per second.", "short", [
        ("computed", rate("radixserve:prefill_tokens_total")),
        ("from cache", rate("radixserve:cached_tokens_total")),
    ], True),
    ("Token throughput", "Tokens per second in (prompts) and out (generated).", "short", [
        ("in", rate("radixserve:prompt_tokens_total")),
        ("out", rate("radixserve:generation_tokens_total")),
    ], False),
    ("Time to first token", "P50 and P99.", "s",
     latency_targets("radixserve:time_to_first_token_seconds"), False),
    ("Inter-token latency", "P50 and P99.", "s",
     latency_targets("radixserve:inter_token_latency_seconds"), False),
    ("End-to-end request latency", "P50 and P99.", "s",
     latency_targets("radixserve:e2e_request_latency_seconds"), False),
    ("Retractions and evictions", "Per minute, under KV memory pressure.", "short", [
        ("retractions", f"sum(increase(radixserve:num_retractions_total{SEL}[1m]))"),
        ("evicted pages", f"sum(increase(radixserve:evicted_pages_total{SEL}[1m]))"),
    ], False),
    ("Speculative acceptance", "Accepted / verified draft tokens, and tokens per verify step "
     "(--speculative-algorithm; empty when off).", "none", [
        ("acceptance rate", f"{rate('radixserve:spec_accepted_tokens_total')} / "
                            f"{rate('radixserve:spec_draft_tokens_total')}"),
        ("tokens per step", f"avg(radixserve:spec_accept_length{SEL})"),
    ], False),
]  # fmt: skip
TREE_NOTE = (
    "The radix tree (largest cached prefixes, hit counts) is not a Prometheus metric: "
    "open `/dashboard` on the server for it."
)


def timeseries(panel_id: int, title: str, description: str, unit: str, targets, stacked):
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {
            "h": 8,
            "w": 12,
            "x": 12 * ((panel_id - 1) % 2),
            "y": 8 * ((panel_id - 1) // 2),
        },
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "color": {"mode": "palette-classic"},
                "custom": {
                    "fillOpacity": 30 if stacked else 0,
                    "stacking": {"group": "A", "mode": "normal" if stacked else "none"},
                },
            },
            "overrides": [],
        },
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "none"},
        },
        "targets": [
            {
                "datasource": DATASOURCE,
                "expr": expr,
                "legendFormat": legend,
                "range": True,
                "refId": chr(ord("A") + i),
            }
            for i, (legend, expr) in enumerate(targets)
        ],
    }


def variable(name: str, query: str) -> dict:
    return {
        "name": name,
        "type": "query",
        "datasource": DATASOURCE,
        "query": query,
        "definition": query,
        "includeAll": True,
        "multi": True,
        "current": {"selected": True, "text": "All", "value": "$__all"},
        "refresh": 2,
    }


def dashboard() -> dict:
    panels = [timeseries(i, *spec) for i, spec in enumerate(PANELS, start=1)]
    note_y = 8 * ((len(PANELS) + 1) // 2)
    panels.append(
        {
            "id": len(PANELS) + 1,
            "type": "text",
            "title": "Radix tree",
            "gridPos": {"h": 3, "w": 24, "x": 0, "y": note_y},
            "options": {"mode": "markdown", "content": TREE_NOTE},
        }
    )
    running = "radixserve:num_requests_running"
    return {
        "__inputs": [
            {
                "name": "DS_PROMETHEUS",
                "label": "Prometheus",
                "type": "datasource",
                "pluginId": "prometheus",
                "pluginName": "Prometheus",
            }
        ],
        "title": "radixserve",
        "uid": "radixserve",
        "description": "radixserve: requests, KV pool, radix cache, throughput, latency",
        "editable": True,
        "schemaVersion": 39,
        "refresh": "5s",
        "time": {"from": "now-30m", "to": "now"},
        "tags": ["radixserve", "llm"],
        "templating": {
            "list": [
                variable("job", f"label_values({running}, job)"),
                variable("instance", f'label_values({running}{{job=~"$job"}}, instance)'),
            ]
        },
        "panels": panels,
    }


if __name__ == "__main__":
    OUT.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {OUT}")
