#!/usr/bin/env python3
"""The GPU check, run from the bundle that scripts/gpu-bundle.sh makes
(run-gpu-check.sh calls this). Needs only the bundle, a CUDA driver and
python3 (PyTorch for the comparison); nothing is built or installed.

Steps, each under `timeout`, all within BUDGET_S (under 5 minutes):
  1. nvidia-smi: is there a CUDA device?
  2. ldd of every bundled binary with the bundle's libraries: none missing;
  3. every GPU test binary (--gtest_brief=1). With a device a skipped test
     is a failure; without one the tests must skip;
  4. (device) the GPU benchmark and PyTorch's scaled_dot_product_attention
     on the same prefill shapes;
  4b. (device) compute-sanitizer memcheck, racecheck and synccheck on a
     subset of cuda_backend_test (skipped with a note when
     compute-sanitizer is not on the machine, or when the budget has no
     room left for it);
  5. attention-server --backend=cuda with `attnctl info` and `attnctl demo`
     (session + prefill + decode stream against the stateless call: the
     maximum difference is printed, 0 for float32). Without a device the
     server must refuse --backend=cuda with UNAVAILABLE, and --backend=auto
     must fall back to the CPU and pass the same demo.

Writes into $OUT (else ./gpu-check-results): gpu-check.log (everything
printed), gpu_check.json (the summary), server.log and, with a device,
gpu_bench.json and sdpa_bench.json.

Exit status: 0 the check passed on a CUDA device; 2 no CUDA device (the
bundle itself works: libraries resolve, tests skip, the CPU fallback
serves); 1 anything failed.

usage: run-gpu-check.sh [--quick]
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BUDGET_S = 285
LIMITS_S = {"nvidia-smi": 20, "ldd": 30, "test": 120, "bench": 100,
            "sdpa": 60, "sanitizer": 25, "server-start": 30, "attnctl": 30,
            "server-stop": 15}
# Time kept for the server checks after the sanitizers.
SERVER_RESERVE_S = 60
SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck")
# A few small GPU tests that cover every kernel (split and full mode, MMA
# narrow and wide, SIMT, weights, merges): sanitizers slow kernels down
# 10-100x.
SANITIZER_FILTER = ("*StatelessMatchesCpu*:*EmptyRowPolicies*:"
                    "*ForcedFullMode*:*LogitOverflowBoundaries*:"
                    "*WideHeadMatchesCpuTest*/bfloat16_dim256_gqa8_q_fp32_causal")


class Runner:
    def __init__(self, dest, quick):
        self.dest = dest
        self.quick = quick
        self.start = time.monotonic()
        self.deadline = self.start + BUDGET_S
        self.log_file = open(os.path.join(dest, "gpu-check.log"), "w")
        self.tmp = tempfile.mkdtemp(prefix="gpu-check-")
        self.steps = []
        self.problems = []
        lib = os.path.join(HERE, "lib")
        self.env = dict(os.environ)
        self.env["LD_LIBRARY_PATH"] = ":".join(
            p for p in [lib, os.environ.get("LD_LIBRARY_PATH", "")] if p)

    def log(self, text=""):
        print(text, flush=True)
        self.log_file.write(text + "\n")
        self.log_file.flush()

    def section(self, title):
        self.log()
        self.log(f"=== {title} ({time.strftime('%H:%M:%S')}, "
                 f"{self.elapsed():.0f} s)")

    def elapsed(self):
        return time.monotonic() - self.start

    def limit(self, step):
        return int(min(LIMITS_S[step], self.deadline - time.monotonic()))

    def problem(self, text):
        self.log(f"PROBLEM: {text}")
        self.problems.append(text)

    def run(self, name, step, argv, bundled=True, quiet=False):
        """Runs argv under `timeout`; returns (rc, output). rc 124: timed
        out. Output is echoed line by line unless quiet."""
        limit = self.limit(step)
        record = {"name": name, "limit_s": limit}
        self.steps.append(record)
        if limit < 3:
            record.update(rc=None, skipped="out of time")
            self.problem(f"{name}: no time left in the {BUDGET_S} s budget")
            return 124, ""
        t0 = time.monotonic()
        lines = []
        try:
            proc = subprocess.Popen(
                ["timeout", "-k", "5", str(limit)] + argv,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                errors="replace", env=self.env if bundled else None)
        except OSError as e:
            record.update(rc=None, error=str(e))
            return 127, str(e)
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if not quiet:
                self.log(lines[-1])
        rc = proc.wait()
        record.update(rc=rc, seconds=round(time.monotonic() - t0, 1),
                      timed_out=rc in (124, 137))
        if rc in (124, 137):
            self.problem(f"{name}: timed out after {limit} s")
        return rc, "\n".join(lines)


def nvidia_smi(r):
    r.section("machine")
    info = {"present": False, "gpus": []}
    if not shutil.which("nvidia-smi"):
        r.log("nvidia-smi: not installed")
        rc = 127
    else:
        rc, text = r.run("nvidia-smi", "nvidia-smi", ["nvidia-smi"],
                         bundled=False)
    if rc == 0:
        rc, text = r.run(
            "nvidia-smi query", "nvidia-smi",
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
             "compute_cap", "--format=csv,noheader"], bundled=False)
        info["gpus"] = [l.strip() for l in text.splitlines()
                        if rc == 0 and l.strip()]
    info["present"] = bool(info["gpus"]) or os.path.exists("/dev/nvidia0")
    r.log(f"CUDA device: {', '.join(info['gpus']) or 'none'}"
          + ("" if info["present"] else " (no CUDA device)"))
    return info


def bundled_binaries():
    out = []
    for folder in ("bin", "tests"):
        path = os.path.join(HERE, folder)
        if os.path.isdir(path):
            out += [os.path.join(path, n) for n in sorted(os.listdir(path))]
    return out


def unresolved(r):
    """{binary: [what ldd cannot find]} with r.env's LD_LIBRARY_PATH."""
    missing = {}
    for binary in bundled_binaries():
        rc, text = r.run(f"ldd {os.path.basename(binary)}", "ldd",
                         ["ldd", binary], quiet=True)
        gone = [l.strip() for l in text.splitlines() if "not found" in l]
        if rc != 0 or gone:
            missing[os.path.basename(binary)] = gone or [f"ldd rc={rc}"]
    return missing


def libraries(r):
    """Every library must resolve: from the system's glibc and libstdc++
    and the bundle's lib/, else with lib/compat/ (the bundle's libstdc++)
    too, which then serves every later step."""
    r.section("libraries (ldd with the bundle's lib/)")
    missing = unresolved(r)
    compat = False
    if missing:
        r.log(f"with lib/ alone: {missing}")
        r.log("retrying with lib/compat/ (the bundle's libstdc++, libgcc_s)")
        r.env["LD_LIBRARY_PATH"] = ":".join(
            [os.path.join(HERE, "lib", "compat"), r.env["LD_LIBRARY_PATH"]])
        missing, compat = unresolved(r), True
    for binary in bundled_binaries():
        name = os.path.basename(binary)
        if name in missing:
            r.problem(f"{name}: cannot resolve {missing[name]}")
        else:
            r.log(f"{name}: every library resolves")
    return {"ok": not missing, "missing": missing, "compat": compat}


def gtest_counts(json_path):
    counts = {"tests": 0, "passed": 0, "failed": 0, "skipped": 0,
              "failed_names": [], "skipped_names": []}
    try:
        with open(json_path) as f:
            report = json.load(f)
    except (OSError, ValueError):
        return None
    for suite in report.get("testsuites", []):
        for case in suite.get("testsuite", []):
            name = f"{suite['name']}.{case['name']}"
            counts["tests"] += 1
            if case.get("failures"):
                counts["failed"] += 1
                counts["failed_names"].append(name)
            elif case.get("result") == "SKIPPED":
                counts["skipped"] += 1
                if len(counts["skipped_names"]) < 10:  # the first ten
                    counts["skipped_names"].append(name)
            else:
                counts["passed"] += 1
    return counts


def gpu_tests(r, device):
    results = []
    for binary in sorted(os.listdir(os.path.join(HERE, "tests"))):
        r.section(f"GPU test {binary}")
        report = os.path.join(r.tmp, binary + ".json")
        rc, text = r.run(binary, "test",
                         [os.path.join(HERE, "tests", binary),
                          "--gtest_brief=1", f"--gtest_output=json:{report}"],
                         quiet=True)
        counts = gtest_counts(report) or {"tests": 0}
        lines = text.splitlines()
        if rc == 0 and not counts.get("failed") and not (
                device and counts.get("skipped")):
            # All as expected: the skip reason once and gtest's summary.
            lines = [l for l in lines if l.startswith("[")][-3:] + [
                l for l in lines if "UNAVAILABLE" in l][:1]
        for line in lines:
            r.log(line)
        result = {"binary": binary, "rc": rc, **counts}
        results.append(result)
        r.log(f"{binary}: rc={rc}, {counts.get('passed', 0)} passed, "
              f"{counts.get('failed', 0)} failed, "
              f"{counts.get('skipped', 0)} skipped")
        if rc != 0 or counts.get("failed"):
            r.problem(f"{binary} failed (rc={rc})")
        elif not counts["tests"]:
            r.problem(f"{binary} ran no test")
        elif device and counts["skipped"]:
            r.problem(f"{binary}: {counts['skipped']} tests skipped on a "
                      "machine with a CUDA device (a skip counts as a "
                      "failure there)")
    return results


def benchmarks(r):
    quick = ["--quick"] if r.quick else []
    r.section("GPU benchmark (attention_gpu_bench)")
    ours_path = os.path.join(r.dest, "gpu_bench.json")
    rc, _ = r.run("attention_gpu_bench", "bench",
                  [os.path.join(HERE, "bin", "attention_gpu_bench"),
                   f"--json={ours_path}"] + quick)
    if rc != 0:
        r.problem(f"attention_gpu_bench failed (rc={rc})")
    r.section("PyTorch scaled_dot_product_attention (sdpa_bench.py)")
    torch_path = os.path.join(r.dest, "sdpa_bench.json")
    rc_torch, _ = r.run("sdpa_bench.py", "sdpa",
                        [sys.executable, os.path.join(HERE, "sdpa_bench.py"),
                         "--json", torch_path] + quick, bundled=False,
                        quiet=True)
    if rc_torch != 0:
        r.problem(f"sdpa_bench.py failed (rc={rc_torch})")
    ours, torch = load_json(ours_path), load_json(torch_path)
    summary = {"benchmark_ok": rc == 0, "gpu_bench": ours,
               "sdpa_bench": torch}
    if torch and torch.get("skipped"):
        r.log(f"PyTorch comparison skipped: {torch['skipped']}")
    decode = [d for d in (ours or {}).get("decode", [])
              if "kernel_gbps" in d and d["context"] >= 8192
              and "case" not in d]
    long_context = [d for d in (ours or {}).get("decode", [])
                    if d.get("case") == "long_context_gqa8"]
    if long_context:
        lc = long_context[0]
        summary["long_context"] = lc
        r.log(f"long-context batch (64 x 128k, GQA 64/8): "
              f"{lc['kernel_ms']:.2f} ms, {lc['kernel_gbps']:.0f} GB/s "
              f"({lc['ratio_to_copy']:.0%} of copy)")
    if decode:
        best = max(decode, key=lambda d: d["kernel_gbps"])
        summary["decode_best"] = best
        r.log(f"decode best: {best['kernel_gbps']:.0f} GB/s "
              f"({best['ratio_to_4800gbps']:.0%} of 4.8 TB/s, "
              f"{best['ratio_to_copy']:.0%} of copy) at context "
              f"{best['context']} batch {best['batch']}")
    theirs = {p["tokens"]: p for p in (torch or {}).get("prefill", [])}
    rows = []
    for p in (ours or {}).get("prefill", []):
        row = {"tokens": p["tokens"], "ours_tflops": p["kernel_tflops"]}
        if p["tokens"] in theirs:
            row["torch_tflops"] = theirs[p["tokens"]]["tflops"]
            row["ratio"] = round(p["kernel_tflops"] / row["torch_tflops"], 3)
        rows.append(row)
        r.log("prefill T=%d: %.1f TFLOP/s%s" % (
            p["tokens"], p["kernel_tflops"],
            "" if "ratio" not in row else ", torch %.1f, ratio %.2f" % (
                row["torch_tflops"], row["ratio"])))
    summary["prefill_vs_torch"] = rows
    # Issue 16 item 6: head_dim 192/256 (wide tensor-core kernel) beside 128.
    wide = (ours or {}).get("wide_head", [])
    summary["wide_head"] = wide
    for w in wide:
        unit = "TFLOP/s" if "kernel_tflops" in w else "GB/s"
        value = w.get("kernel_tflops", w.get("kernel_gbps", 0.0))
        r.log("wide head %s head_dim %d T=%d: %.1f %s (%.2f x head_dim 128)"
              % (w["kind"], w["head_dim"], w["tokens"], value, unit,
                 w["ratio_to_dim128"]))
    return summary


def find_sanitizer():
    found = shutil.which("compute-sanitizer")
    for path in (found, "/usr/local/cuda/bin/compute-sanitizer",
                 "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):
        if path and os.access(path, os.X_OK):
            return path
    return None


def sanitizers(r):
    """compute-sanitizer on cuda_backend_test; a note, not a problem, when
    the tool is absent or the budget has no room left for it."""
    r.section("compute-sanitizer on cuda_backend_test")
    tool_path = find_sanitizer()
    test = os.path.join(HERE, "tests", "cuda_backend_test")
    if tool_path is None:
        r.log("NOTE: compute-sanitizer is not installed here; skipped")
        return {"skipped": "compute-sanitizer not found"}
    if not os.path.exists(test):
        r.problem("cuda_backend_test is not in the bundle")
        return {"skipped": "no cuda_backend_test"}
    results = {}
    for tool in SANITIZER_TOOLS:
        left = r.deadline - time.monotonic()
        if left < LIMITS_S["sanitizer"] + SERVER_RESERVE_S:
            r.log(f"NOTE: {tool} skipped: {left:.0f} s left in the budget")
            results[tool] = {"skipped": "out of time"}
            continue
        rc, text = r.run(
            f"compute-sanitizer {tool}", "sanitizer",
            [tool_path, f"--tool={tool}", "--error-exitcode=3",
             "--print-limit=20", test, "--gtest_brief=1",
             f"--gtest_filter={SANITIZER_FILTER}"], quiet=True)
        summary = [l for l in text.splitlines() if "ERROR SUMMARY" in l or
                   "RACECHECK SUMMARY" in l]
        errors = [l for l in text.splitlines() if l.startswith("=========")
                  and ("Error" in l or "Hazard" in l)][:10]
        for line in summary + errors:
            r.log(line)
        if rc in (124, 137):
            # Timed out (run() already counted it): nothing was found.
            results[tool] = {"rc": rc, "timed_out": True}
            r.problems.pop()
            r.log(f"NOTE: {tool} timed out after {LIMITS_S['sanitizer']} s; "
                  "no error reported before that")
            continue
        results[tool] = {"rc": rc, "summary": summary, "errors": errors}
        r.log(f"{tool}: rc={rc}")
        if rc != 0:
            r.problem(f"compute-sanitizer {tool} found errors (rc={rc})")
    return results


def load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


class Server:
    """attention-server on a free loopback port, output into server.log."""

    def __init__(self, r, backend):
        self.r = r
        self.port_file = os.path.join(r.tmp, f"port-{backend}")
        log = open(os.path.join(r.dest, "server.log"), "a")
        log.write(f"--- attention-server --backend={backend}\n")
        log.flush()
        self.log_start = log.tell()
        self.log_path = log.name
        self.proc = subprocess.Popen(
            [os.path.join(HERE, "bin", "attention-server"),
             f"--backend={backend}", "--port=0",
             f"--port_file={self.port_file}", "--listen_address=127.0.0.1",
             "--metrics_port=-1", "--drain_timeout=5s",
             "--kv_cache_bytes=268435456"],
            stdout=log, stderr=subprocess.STDOUT, env=r.env)
        log.close()

    def output(self):
        with open(self.log_path, errors="replace") as f:
            f.seek(self.log_start)
            return f.read()

    def wait_for_port(self):
        """The port, or None when the server exited or took too long."""
        deadline = time.monotonic() + self.r.limit("server-start")
        while time.monotonic() < deadline:
            try:
                with open(self.port_file) as f:
                    return int(f.read().strip())
            except (OSError, ValueError):
                pass
            if self.proc.poll() is not None:
                return None
            time.sleep(0.1)
        return None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=LIMITS_S["server-stop"])
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                self.r.problem("attention-server ignored SIGTERM")
        return self.proc.returncode


def demo(r, port, kv_dtype=None):
    argv = [os.path.join(HERE, "bin", "attnctl"), "demo",
            f"--target=127.0.0.1:{port}"]
    if kv_dtype:
        argv.append(f"--kv_dtype={kv_dtype}")
    rc, text = r.run(f"attnctl demo {kv_dtype or 'float32'}", "attnctl", argv)
    match = re.search(r"max abs difference: (\S+)", text)
    return {"kv_dtype": kv_dtype or "float32", "rc": rc,
            "max_abs_difference": float(match.group(1)) if match else None}


def serve(r, backend):
    """Starts the server, runs attnctl info + demos, stops it."""
    r.section(f"attention-server --backend={backend} + attnctl demo")
    server = Server(r, backend)
    port = server.wait_for_port()
    result = {"backend_flag": backend, "started": port is not None}
    start_line = next((l for l in server.output().splitlines()
                       if " listening on " in l), "")
    r.log(start_line or server.output().strip())
    match = re.search(r"backend=(\w+) \((.*?)\) device=", start_line)
    if match:
        result["backend"], result["reason"] = match.group(1), match.group(2)
    if port is None:
        result["exit_code"] = server.stop()
        result["error"] = server.output().strip().splitlines()[-1:]
        return result
    rc, _ = r.run("attnctl info", "attnctl",
                  [os.path.join(HERE, "bin", "attnctl"), "info",
                   f"--target=127.0.0.1:{port}"])
    result["info_ok"] = rc == 0
    result["demos"] = [demo(r, port), demo(r, port, "bf16")]
    result["exit_code"] = server.stop()
    result["ok"] = (rc == 0 and result["exit_code"] == 0 and
                    all(d["rc"] == 0 for d in result["demos"]))
    return result


def server_checks(r, device):
    if device:
        result = serve(r, "cuda")
        if not result.get("ok") or result.get("backend") != "cuda":
            r.problem(f"attention-server --backend=cuda: {result}")
        return {"cuda": result}
    # No device: --backend=cuda must refuse to start, clearly; auto must
    # serve on the CPU and say why.
    refused = serve(r, "cuda")
    message = " ".join(refused.get("error", []))
    refused["refused_clearly"] = (not refused["started"] and
                                  refused.get("exit_code") not in (0, None)
                                  and "UNAVAILABLE" in message)
    r.log(f"--backend=cuda without a device: exit {refused.get('exit_code')}"
          f": {message}")
    if not refused["refused_clearly"]:
        r.problem("--backend=cuda without a device did not fail at start-up "
                  "with UNAVAILABLE")
    fallback = serve(r, "auto")
    if not fallback.get("ok") or fallback.get("backend") != "cpu":
        r.problem(f"--backend=auto without a device: {fallback}")
    return {"cuda": refused, "auto": fallback}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smaller benchmark sizes")
    args = parser.parse_args()
    dest = os.environ.get("OUT") or os.path.join(os.getcwd(),
                                                 "gpu-check-results")
    os.makedirs(dest, exist_ok=True)
    r = Runner(dest, args.quick)
    r.log(f"attention-service GPU check, bundle {HERE}, results in {dest}")
    bundle = load_json(os.path.join(HERE, "bundle.json")) or {}
    r.log(f"bundle: {bundle.get('commit', '?')} built "
          f"{bundle.get('built', '?')}, GPU code {bundle.get('sm', '?')}")

    device = nvidia_smi(r)
    summary = {"result": None, "device": device, "bundle": bundle,
               "quick": args.quick}
    summary["libraries"] = libraries(r)
    summary["gpu_tests"] = gpu_tests(r, device["present"])
    if device["present"]:
        summary.update(benchmarks(r))
        summary["sanitizers"] = sanitizers(r)
    else:
        summary["benchmarks"] = "skipped: no CUDA device"
        summary["sanitizers"] = "skipped: no CUDA device"
    summary["server"] = server_checks(r, device["present"])

    if r.problems:
        summary["result"] = "failed"
    elif not device["present"]:
        summary["result"] = "no_cuda_device"
    else:
        summary["result"] = "passed"
    summary["problems"] = r.problems
    summary["steps"] = r.steps
    summary["seconds"] = round(r.elapsed(), 1)
    with open(os.path.join(dest, "gpu_check.json"), "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")

    r.section("summary")
    for problem in r.problems:
        r.log(f"  problem: {problem}")
    verdict = {"passed": "PASSED on " + ", ".join(device["gpus"]),
               "failed": "FAILED",
               "no_cuda_device": "no CUDA device: nothing was checked on a "
                                 "GPU (the bundle itself works)"}
    r.log(f"gpu-check: {verdict[summary['result']]}; "
          f"{summary['seconds']} s; results in {dest}")
    return {"passed": 0, "no_cuda_device": 2}.get(summary["result"], 1)


if __name__ == "__main__":
    sys.exit(main())
