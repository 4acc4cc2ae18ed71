#!/usr/bin/env python3
"""A real attention-server scraped by a real Prometheus.

Starts attention-server (metrics on a free port) and Prometheus (scraping it
every second, with deploy/prometheus/alerts.yml loaded), drives traffic with
`attnctl info` and `attnctl demo`, and asserts through Prometheus' HTTP query
API that
  - the request counters moved by exactly what the demos did (each demo:
    1 CreateSession, 2 Prefill, 2 x decode_steps Decode stream steps,
    2 Attention, 1 DeleteSession), with no error code, and the duration
    histograms counted the same calls;
  - the token counters and the session counters match too;
  - the KV gauges report the configured pool, rose while sessions held
    blocks, and are back to zero once the demos deleted their sessions;
  - the alert rules load and evaluate, and none fires.
Then `promtool check metrics` must print nothing on a scrape. Last, with one
session kept, SIGTERM drains the server, which writes the session to its
--snapshot_dir and keeps /metrics up for --metrics_linger: Prometheus must
scrape the snapshot's count after the drain; a second SIGTERM then ends the
linger, with exit status 0.

Usage: prometheus_integration_test.py --server BIN --attnctl BIN
           --prometheus BIN --promtool BIN --rules FILE
"""

import argparse
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

KV_CACHE_BYTES = 64 << 20
KV_BLOCK_BYTES = 64 << 10
PROMPT_TOKENS = 64
DECODE_STEPS = 48
DEMO_WORKERS = 2
MAX_DEMOS_PER_WORKER = 400  # bounded; the workers stop once a scrape saw KV in use
METRICS_LINGER_S = 120  # ended early by the second SIGTERM


class TestFailure(Exception):
    pass


_picked_ports = set()


def free_port():
    """A port on 127.0.0.1 free right now, not picked before, below the
    kernel's ephemeral range when there is room: a port from that range,
    once released, can be taken by any connection opened meanwhile."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            high = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        high = 32768
    low = max(1024, high - 16384)
    for _ in range(64):
        port = random.randrange(low, high) if high - low >= 256 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _picked_ports:
            _picked_ports.add(port)
            return port
    raise TestFailure("no free port on 127.0.0.1")


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status, response.read().decode("utf-8")


def wait_for(what, predicate, timeout, interval=0.25):
    deadline = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < deadline:
        try:
            result = predicate()
            if result:
                return result
        except (OSError, urllib.error.URLError, ValueError, KeyError) as error:
            last_error = error
        time.sleep(interval)
    raise TestFailure(f"timed out after {timeout} s waiting for {what}"
                      + (f" (last error: {last_error})" if last_error else ""))


class Prometheus:
    def __init__(self, port):
        self.base = f"http://127.0.0.1:{port}"

    def api(self, path, **params):
        url = f"{self.base}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        status, body = http_get(url)
        reply = json.loads(body)
        if reply.get("status") != "success":
            raise TestFailure(f"Prometheus {path} {params}: {reply}")
        return reply["data"]

    def query(self, expression):
        """The instant vector's values, as floats ([] when empty)."""
        data = self.api("query", query=expression)
        if data["resultType"] == "scalar":
            return [float(data["result"][1])]
        return [float(sample["value"][1]) for sample in data["result"]]

    def value(self, expression):
        values = self.query(expression)
        if len(values) != 1:
            raise TestFailure(f"{expression}: expected one sample, got {values}")
        return values[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    for name in ("server", "attnctl", "prometheus", "promtool", "rules"):
        parser.add_argument(f"--{name}", required=True)
    args = parser.parse_args()
    for name in ("server", "attnctl", "prometheus", "promtool", "rules"):
        value = getattr(args, name)
        if os.sep in value:  # a path, not a command looked up on PATH
            setattr(args, name, os.path.abspath(value))

    for name in ("prometheus", "promtool"):
        if shutil.which(getattr(args, name)) is None:
            print(f"FAIL: {getattr(args, name)} not found: install Debian "
                  "package prometheus", file=sys.stderr)
            return 1

    work = tempfile.mkdtemp(prefix="attention-prometheus-test-")
    processes = []
    try:
        run(args, work, processes)
    except TestFailure as failure:
        print(f"FAIL: {failure}", file=sys.stderr)
        for name, process, log in processes:
            if os.path.exists(log):
                print(f"--- {name} log (last 40 lines) ---", file=sys.stderr)
                with open(log, encoding="utf-8", errors="replace") as f:
                    print("".join(f.readlines()[-40:]), file=sys.stderr)
        return 1
    finally:
        for name, process, log in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        shutil.rmtree(work, ignore_errors=True)
    print("prometheus integration test passed")
    return 0


def start(processes, name, argv, work):
    log = os.path.join(work, f"{name}.log")
    process = subprocess.Popen(argv, stdout=open(log, "w"),
                               stderr=subprocess.STDOUT, cwd=work)
    processes.append((name, process, log))
    return process


def attnctl(args, target, *command):
    result = subprocess.run([args.attnctl, *command, f"--target={target}"],
                            capture_output=True, text=True, timeout=120,
                            check=False)
    if result.returncode != 0:
        raise TestFailure(f"attnctl {' '.join(command)} exited "
                          f"{result.returncode}: {result.stdout}{result.stderr}")
    return result.stdout


def run(args, work, processes):
    # --- the server --------------------------------------------------------
    metrics_port = free_port()
    port_file = os.path.join(work, "grpc.port")
    server = start(processes, "attention-server", [
        args.server, "--listen_address=127.0.0.1", "--port=0",
        f"--port_file={port_file}", f"--metrics_port={metrics_port}",
        "--backend=cpu", "--threads=2", f"--kv_cache_bytes={KV_CACHE_BYTES}",
        f"--kv_block_bytes={KV_BLOCK_BYTES}",
        f"--snapshot_dir={os.path.join(work, 'snapshots')}",
        f"--metrics_linger={METRICS_LINGER_S}s"], work)

    def port_written():
        if server.poll() is not None:
            raise TestFailure(f"attention-server exited with {server.returncode}")
        with open(port_file) as f:
            return int(f.read().strip())
    grpc_port = wait_for("the server's port file", port_written, 60)
    target = f"127.0.0.1:{grpc_port}"
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        wait_for(f"{metrics_url}", lambda: http_get(metrics_url)[0] == 200, 15)
    except TestFailure as failure:
        raise TestFailure(
            f"attention-server does not serve {metrics_url} ({failure}); the "
            "server must start ServerMetrics on --metrics_port") from None
    print(f"attention-server: gRPC {target}, metrics {metrics_url}")

    # --- Prometheus --------------------------------------------------------
    prometheus_port = free_port()
    shutil.copy(args.rules, os.path.join(work, "alerts.yml"))
    with open(os.path.join(work, "prometheus.yml"), "w") as f:
        f.write(f"""global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files:
  - alerts.yml
scrape_configs:
  - job_name: attention-server
    static_configs:
      - targets: ['127.0.0.1:{metrics_port}']
""")
    start(processes, "prometheus", [
        args.prometheus, f"--config.file={work}/prometheus.yml",
        f"--storage.tsdb.path={work}/data",
        f"--web.listen-address=127.0.0.1:{prometheus_port}",
        "--log.level=warn"], work)
    prometheus = Prometheus(prometheus_port)
    wait_for("Prometheus to be ready", lambda: http_get(
        f"{prometheus.base}/-/ready")[0] == 200, 60)
    wait_for("the first successful scrape", lambda: prometheus.query(
        'up{job="attention-server"} == 1') == [1.0], 30)

    sel = '{job="attention-server"}'

    def requests(method, code="OK"):
        return prometheus.value(
            f'sum(attention_requests_total{{job="attention-server",'
            f'method="{method}",code="{code}"}})')

    # Before any traffic: the configured pool, nothing used.
    expect("KV capacity", prometheus.value(f"attention_kv_cache_capacity_bytes{sel}"),
           KV_CACHE_BYTES)
    expect("KV blocks capacity", prometheus.value(f"attention_kv_blocks_capacity{sel}"),
           KV_CACHE_BYTES // KV_BLOCK_BYTES)
    expect("KV used before traffic",
           prometheus.value(f"attention_kv_cache_used_bytes{sel}"), 0)
    expect("sessions before traffic",
           prometheus.value(f"attention_sessions_active{sel}"), 0)
    expect("build info", prometheus.value(
        'attention_build_info{job="attention-server",backend="cpu"}'), 1)
    expect("requests before traffic",
           prometheus.value(f"sum(attention_requests_total{sel})"), 0)

    # --- traffic -----------------------------------------------------------
    info = attnctl(args, target, "info")
    print(info.rstrip())
    info_calls = 1

    # Demo sessions live for a fraction of a second, so keep demos running
    # until Prometheus has seen a session holding KV blocks (bounded).
    demos = [0] * DEMO_WORKERS
    errors = []
    seen = threading.Event()

    def worker(index):
        while not seen.is_set() and demos[index] < MAX_DEMOS_PER_WORKER:
            try:
                attnctl(args, target, "demo", f"--prompt_tokens={PROMPT_TOKENS}",
                        f"--decode_steps={DECODE_STEPS}", f"--seed={index + 1}")
            except TestFailure as failure:
                errors.append(str(failure))
                return
            demos[index] += 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(DEMO_WORKERS)]
    for thread in threads:
        thread.start()
    try:
        def kv_seen():
            if errors or not any(t.is_alive() for t in threads):
                return True  # stop waiting; checked below
            used = prometheus.query(f"max_over_time(attention_kv_cache_used_bytes{sel}[5m]) > 0")
            active = prometheus.query(f"max_over_time(attention_sessions_active{sel}[5m]) > 0")
            return bool(used and active)
        wait_for("a scrape during a demo session", kv_seen, 120, interval=0.5)
    finally:
        seen.set()
        for thread in threads:
            thread.join()
    if errors:
        raise TestFailure(errors[0])
    n = sum(demos)
    print(f"ran {n} demos ({PROMPT_TOKENS} prompt tokens, {DECODE_STEPS} "
          f"decode steps, 2 layers each)")

    # Wait until a scrape after the last demo has been ingested.
    wait_for("the final counters", lambda: requests("DeleteSession") == n, 30)
    # A scrape past the last deletion: the gauges are back to zero (bounded
    # wait; under load a scrape may come late).
    wait_for("a scrape after the last deletion", lambda: prometheus.value(
        f"attention_sessions_active{sel} + attention_kv_cache_used_bytes{sel}"
        f" + attention_streams_active{sel}") == 0, 30)

    # --- assertions --------------------------------------------------------
    peak_used = prometheus.value(f"max_over_time(attention_kv_cache_used_bytes{sel}[5m])")
    peak_blocks = prometheus.value(f"max_over_time(attention_kv_blocks_used{sel}[5m])")
    peak_ratio = prometheus.value(f"max_over_time(attention_kv_cache_usage_ratio{sel}[5m])")
    if not (peak_used > 0 and peak_blocks > 0 and 0 < peak_ratio <= 1):
        raise TestFailure(f"KV gauges never rose: used {peak_used}, blocks "
                          f"{peak_blocks}, ratio {peak_ratio}")
    expect("peak used bytes = peak blocks x block size", peak_used,
           peak_blocks * KV_BLOCK_BYTES)

    expect("CreateSession OK", requests("CreateSession"), n)
    expect("Prefill OK", requests("Prefill"), 2 * n)
    expect("Decode OK (stream steps)", requests("Decode"), 2 * DECODE_STEPS * n)
    expect("Attention OK", requests("Attention"), 2 * n)
    expect("DeleteSession OK", requests("DeleteSession"), n)
    expect("GetServerInfo OK", requests("GetServerInfo"), info_calls)
    expect("requests with an error code", prometheus.value(
        'sum(attention_requests_total{job="attention-server",code!="OK"})'), 0)
    expect("all requests", prometheus.value(f"sum(attention_requests_total{sel})"),
           n * (1 + 2 + 2 * DECODE_STEPS + 2 + 1) + info_calls)
    for method, calls in (("Prefill", 2 * n), ("Decode", 2 * DECODE_STEPS * n),
                          ("CreateSession", n)):
        expect(f"{method} duration count", prometheus.value(
            f'attention_request_duration_seconds_count{{job="attention-server",method="{method}"}}'),
            calls)
        expect(f"{method} +Inf bucket", prometheus.value(
            f'attention_request_duration_seconds_bucket{{job="attention-server",method="{method}",le="+Inf"}}'),
            calls)
    p99 = prometheus.value(
        'histogram_quantile(0.99, sum by (le) (increase(attention_request_duration_seconds_bucket'
        '{job="attention-server",method="Prefill"}[5m])))')
    if not (math.isfinite(p99) and 0 < p99 <= 10):
        raise TestFailure(f"Prefill p99 latency {p99} is not within the buckets")

    expect("prefill tokens", prometheus.value(
        'attention_tokens_total{job="attention-server",phase="prefill"}'),
        2 * PROMPT_TOKENS * n)
    expect("decode tokens", prometheus.value(
        'attention_tokens_total{job="attention-server",phase="decode"}'),
        2 * DECODE_STEPS * n)
    expect("sessions created", prometheus.value(f"attention_sessions_created_total{sel}"), n)
    expect("sessions active after the demos",
           prometheus.value(f"attention_sessions_active{sel}"), 0)
    expect("streams active after the demos",
           prometheus.value(f"attention_streams_active{sel}"), 0)
    expect("KV used after the demos",
           prometheus.value(f"attention_kv_cache_used_bytes{sel}"), 0)
    expect("KV blocks used after the demos",
           prometheus.value(f"attention_kv_blocks_used{sel}"), 0)
    expect("KV usage after the demos",
           prometheus.value(f"attention_kv_cache_usage_ratio{sel}"), 0)

    # The alert rules evaluate on the real series; nothing fires.
    groups = prometheus.api("rules")["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    if not rules:
        raise TestFailure("Prometheus loaded no alert rules")
    for rule in rules:
        if rule.get("health") != "ok":
            raise TestFailure(f"rule {rule['name']}: {rule.get('health')} "
                              f"{rule.get('lastError')}")
    firing = [a for a in prometheus.api("alerts")["alerts"] if a["state"] == "firing"]
    if firing:
        raise TestFailure(f"alerts firing: {firing}")
    print(f"{len(rules)} alert rules evaluate, none firing")

    # --- promtool check metrics on a real scrape ---------------------------
    _, scrape = http_get(metrics_url)
    lint = subprocess.run([args.promtool, "check", "metrics"], input=scrape,
                          capture_output=True, text=True, check=False)
    findings = (lint.stdout + lint.stderr).strip()
    if lint.returncode != 0 or findings:
        raise TestFailure(f"promtool check metrics (exit {lint.returncode}): "
                          f"{findings}")
    print(f"promtool check metrics: {len(scrape.splitlines())} lines, clean")

    # --- graceful stop: the drain's counts reach Prometheus ----------------
    attnctl(args, target, "demo", "--keep_session", "--prompt_tokens=8",
            "--decode_steps=2")
    expect("snapshot sessions before the drain", prometheus.value(
        f"attention_snapshot_sessions_written_total{sel}"), 0)
    server.send_signal(signal.SIGTERM)
    wait_for("Prometheus to scrape the drain's snapshot count", lambda:
             prometheus.query(f"attention_snapshot_sessions_written_total{sel}")
             == [1.0], 60)
    expect("snapshot sessions after the drain", prometheus.value(
        f"attention_snapshot_sessions_written_total{sel}"), 1)
    if server.poll() is not None:
        raise TestFailure("attention-server exited before its metrics linger")
    server.send_signal(signal.SIGTERM)  # ends the linger
    try:
        code = server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        raise TestFailure("attention-server did not exit within 60 s of a "
                          "second SIGTERM during its metrics linger")
    if code != 0:
        raise TestFailure(f"attention-server exited with {code} after SIGTERM")


def expect(what, actual, expected):
    if actual != expected:
        raise TestFailure(f"{what}: Prometheus says {actual}, expected {expected}")
    print(f"ok  {what} = {actual:g}")


if __name__ == "__main__":
    sys.exit(main())
