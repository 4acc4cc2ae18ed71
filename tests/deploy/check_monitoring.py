#!/usr/bin/env python3
"""Checks deploy/prometheus, deploy/grafana and deploy/docker-compose.yml.

1. `promtool check config` on prometheus.yml, `promtool check rules` on the
   alert rules and `promtool test rules` on their unit tests; every alert
   must be exercised (expected to fire) by at least one unit test.
2. `promtool check metrics` on the real exposition of ServerMetrics (printed
   by the metrics_exposition_dump tool built from server/metrics.cc) must
   succeed and print nothing at all.
3. Every metric name that the alert rules and the Grafana dashboard query is
   one that ServerMetrics exports (histogram series by their _bucket, _sum
   and _count names), and the dashboard shows every exported family.
4. The compose file mounts files that exist, and Prometheus scrapes the
   compose service on the metrics port that the server is given.

Usage: check_monitoring.py --repo DIR --promtool PATH --metrics-dump PATH
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys

# Metrics that Prometheus itself provides.
PROMETHEUS_METRICS = {"up"}

problems = []


def problem(message):
    problems.append(message)
    print(f"FAIL: {message}", file=sys.stderr)


def run(argv, stdin=None, cwd=None):
    result = subprocess.run(argv, input=stdin, cwd=cwd, capture_output=True,
                            text=True, check=False)
    return result.returncode, result.stdout + result.stderr


def parse_exposition(text):
    """Returns {family: type} and the set of sample names."""
    families = {}
    samples = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            families[name] = kind
        elif line and not line.startswith("#"):
            samples.add(re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0))
    return families, samples


def series_names(families):
    """Every name a query may use for each family."""
    names = {}
    for family, kind in families.items():
        if kind in ("histogram", "summary"):
            for suffix in ("_bucket", "_sum", "_count") if kind == "histogram" \
                    else ("_sum", "_count", ""):
                names[family + suffix] = family
        else:
            names[family] = family
    return names


def queried_metrics(text):
    """Metric names in PromQL text: identifiers not followed by '(' (a
    function) nor used as label names or keywords."""
    names = set()
    # Drop label matchers and strings: {...} and "..." hold label names and
    # values, never metric names.
    stripped = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    stripped = re.sub(r"\{[^}]*\}", "{}", stripped)
    # by (...) / without (...) / on (...) / ignoring (...) list labels.
    stripped = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)",
                      " ", stripped)
    stripped = re.sub(r"\[[^\]]*\]", "", stripped)  # range selectors
    for match in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", stripped):
        name = match.group(0)
        rest = stripped[match.end():].lstrip()
        if rest.startswith("("):
            continue  # a function or aggregation
        if name in ("and", "or", "unless", "bool", "offset", "inf", "nan",
                    "Inf", "NaN", "e"):
            continue
        if name.startswith("$") or re.fullmatch(r"[0-9.e]+", name):
            continue
        names.add(name)
    return names


def rule_expressions(path):
    """The `expr:` of every rule (alerts.yml is a plain YAML subset: the
    expression is either on the line or a `|` block below it)."""
    expressions = []
    lines = open(path, encoding="utf-8").read().splitlines()
    i = 0
    while i < len(lines):
        match = re.match(r"^(\s*)expr:\s*(.*)$", lines[i])
        if not match:
            i += 1
            continue
        indent, value = len(match.group(1)), match.group(2).strip()
        if value in ("|", ">", "|-", ">-"):
            block = []
            i += 1
            while i < len(lines) and (not lines[i].strip() or
                                      len(lines[i]) - len(lines[i].lstrip()) > indent):
                block.append(lines[i].strip())
                i += 1
            expressions.append(" ".join(block))
        else:
            expressions.append(value.strip("'\""))
            i += 1
    return expressions


def dashboard_expressions(path):
    expressions = []

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "expr" and isinstance(value, str):
                    expressions.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    dashboard = json.load(open(path, encoding="utf-8"))
    walk(dashboard.get("panels", []))
    # Template variables of type query (not the data source variable).
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        if isinstance(query, str):
            expressions.append(query)
    return expressions


def label_values_metrics(expression):
    """Metric of a Grafana label_values(metric{...}, label) query."""
    match = re.match(r"\s*label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)", expression)
    return {match.group(1)} if match else None


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repo", required=True)
    parser.add_argument("--promtool", required=True)
    parser.add_argument("--metrics-dump", required=True)
    args = parser.parse_args()
    if shutil.which(args.promtool) is None:
        print(f"FAIL: {args.promtool} not found: install promtool (Debian "
              "package prometheus)", file=sys.stderr)
        return 1
    deploy = os.path.join(args.repo, "deploy")
    prometheus_dir = os.path.join(deploy, "prometheus")
    rules = os.path.join(prometheus_dir, "alerts.yml")
    dashboard = os.path.join(deploy, "grafana", "dashboards",
                             "attention-service.json")

    # 1. promtool on the configuration, the rules and their unit tests.
    for argv in (["check", "config", "prometheus.yml"],
                 ["check", "rules", "alerts.yml"],
                 ["test", "rules", "rules_test.yml"]):
        code, output = run([args.promtool] + argv, cwd=prometheus_dir)
        print(f"$ promtool {' '.join(argv)}\n{output.rstrip()}")
        if code != 0:
            problem(f"promtool {' '.join(argv)} failed")
    alerts = set(re.findall(r"^\s*-\s*alert:\s*(\w+)", open(rules).read(), re.M))
    tests_text = open(os.path.join(prometheus_dir, "rules_test.yml")).read()
    # An alert is exercised when some test expects it with labels.
    exercised = set()
    for block in re.split(r"\n\s*-\s*eval_time:", tests_text):
        name = re.search(r"alertname:\s*(\w+)", block)
        if name and re.search(r"exp_labels:", block):
            exercised.add(name.group(1))
    for alert in sorted(alerts - exercised):
        problem(f"alert {alert} is never expected to fire in rules_test.yml")
    if not alerts:
        problem("no alert rules found")

    # 2. The real exposition, linted.
    code, exposition = run([args.metrics_dump])
    if code != 0:
        problem(f"metrics_exposition_dump failed: {exposition}")
        return finish()
    code, lint = run([args.promtool, "check", "metrics"], stdin=exposition)
    print(f"$ promtool check metrics  (exit {code})\n{lint.rstrip()}")
    if code != 0 or lint.strip():
        problem(f"promtool check metrics must succeed silently (exit {code}): "
                f"{lint.strip()}")
    families, samples = parse_exposition(exposition)
    names = series_names(families)
    print(f"ServerMetrics exports {len(families)} families: "
          f"{', '.join(sorted(families))}")
    for sample in samples:
        if sample not in names:
            problem(f"sample {sample} belongs to no declared family")

    # 3. Names in the rules and the dashboard.
    used = {}
    for source, expressions in (("alerts.yml", rule_expressions(rules)),
                                ("dashboard", dashboard_expressions(dashboard))):
        if not expressions:
            problem(f"no expressions found in {source}")
        for expression in expressions:
            metrics = label_values_metrics(expression)
            if metrics is None:
                metrics = queried_metrics(expression)
            for metric in metrics:
                used.setdefault(metric, set()).add(source)
    for metric, sources in sorted(used.items()):
        if metric not in names and metric not in PROMETHEUS_METRICS:
            problem(f"{', '.join(sorted(sources))} query {metric}, which the "
                    "server does not export")
    dashboard_families = {names[m] for m, s in used.items()
                          if "dashboard" in s and m in names}
    for family in sorted(set(families) - dashboard_families):
        problem(f"the dashboard shows no panel for {family}")
    print(f"queried metrics: {', '.join(sorted(used))}")

    # 4. docker-compose.yml: mounted files exist, the scrape target matches.
    compose_path = os.path.join(deploy, "docker-compose.yml")
    compose = open(compose_path, encoding="utf-8").read()
    for source in re.findall(r"^\s*-\s*(\./[^:\s]+):", compose, re.M):
        if not os.path.exists(os.path.join(deploy, source)):
            problem(f"docker-compose.yml mounts {source}, which does not exist")
    metrics_port = re.search(r"--metrics_port=(\d+)", compose)
    config = open(os.path.join(prometheus_dir, "prometheus.yml")).read()
    if not metrics_port or f"attention-server:{metrics_port.group(1)}" not in config:
        problem("prometheus.yml does not scrape attention-server on the "
                "--metrics_port given in docker-compose.yml")
    if 'job_name: attention-server' not in config:
        problem('prometheus.yml has no job "attention-server" (rules and '
                "dashboard select it)")
    return finish()


def finish():
    if problems:
        print(f"{len(problems)} problem(s)", file=sys.stderr)
        return 1
    print("monitoring configuration is consistent")
    return 0


if __name__ == "__main__":
    sys.exit(main())
