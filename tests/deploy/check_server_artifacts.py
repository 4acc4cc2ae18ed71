#!/usr/bin/env python3
"""Checks that the deployment files fit the binaries they deploy.

1. Every attention-server flag that the deployment passes (the Kubernetes
   ConfigMaps, including the overlays' patches; docker-compose.yml; the
   Dockerfiles' CMD) is a flag the binary defines, and every attnctl flag
   of the HEALTHCHECK is one attnctl defines.
2. `attnctl health` against a port where nothing listens exits 2 (cannot
   connect), as grpc_health_probe does, so that Docker's HEALTHCHECK and
   scripts read its status right.
3. The runtime stage of the CPU Dockerfile installs every shared library
   the binaries load: the packages deploy/docker/runtime-packages.sh finds
   for them are among the Dockerfile's runtime packages or their
   dependencies.

Usage: check_server_artifacts.py --repo DIR --server BIN --attnctl BIN
"""

import argparse
import glob
import os
import re
import socket
import subprocess
import sys

problems = []


def problem(message):
    problems.append(message)
    print(f"FAIL: {message}", file=sys.stderr)


def defined_flags(binary):
    result = subprocess.run([binary, "--helpfull"], capture_output=True,
                            text=True, check=False, timeout=60)
    flags = set(re.findall(r"^\s+--([A-Za-z0-9_]+) \(", result.stdout + result.stderr,
                           re.M))
    if not flags:
        raise SystemExit(f"FAIL: {binary} --helpfull lists no flags")
    return flags


def flags_in(text):
    return set(re.findall(r"--([A-Za-z][A-Za-z0-9_]*)=", text))


def flag_lines_in(text):
    """Flags at the start of a line (flag files, YAML lists), not in
    comments."""
    return set(re.findall(r"^\s*(?:-\s+)?--([A-Za-z][A-Za-z0-9_]*)=", text,
                          re.M))


def dockerfile_array(text, instruction):
    """The exec-form JSON array of the last INSTRUCTION (lines joined)."""
    joined = re.sub(r"\\\n\s*", " ", text)
    matches = re.findall(rf"^{instruction}\s+(.*)$", joined, re.M)
    return matches[-1] if matches else ""


def installed_depends_closure(packages):
    """Packages plus everything they depend on, among installed packages."""
    seen = set()
    todo = list(packages)
    while todo:
        package = todo.pop()
        if package in seen:
            continue
        seen.add(package)
        result = subprocess.run(
            ["dpkg-query", "-W", "-f", "${Depends},${Pre-Depends}", package],
            capture_output=True, text=True, check=False)
        if result.returncode != 0:
            continue
        for alternatives in result.stdout.split(","):
            for alternative in alternatives.split("|"):
                name = alternative.strip().split(" ")[0].split(":")[0]
                if name:
                    todo.append(name)
    return seen


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repo", required=True)
    parser.add_argument("--server", required=True)
    parser.add_argument("--attnctl", required=True)
    args = parser.parse_args()
    repo = args.repo

    # 1. Flags.
    server_flags = defined_flags(args.server)
    attnctl_flags = defined_flags(args.attnctl)
    sources = {}
    for path in sorted(glob.glob(os.path.join(repo, "deploy/k8s/**/*.yaml"),
                                 recursive=True)):
        text = open(path, encoding="utf-8").read()
        if "kind: ConfigMap" in text:
            sources[path] = flag_lines_in(text)
    compose = os.path.join(repo, "deploy/docker-compose.yml")
    sources[compose] = flag_lines_in(open(compose, encoding="utf-8").read())
    for dockerfile in (os.path.join(repo, "Dockerfile"),
                       os.path.join(repo, "deploy/docker/Dockerfile.cuda")):
        text = open(dockerfile, encoding="utf-8").read()
        sources[dockerfile + " CMD"] = flags_in(dockerfile_array(text, "CMD"))
        health = dockerfile_array(text, "HEALTHCHECK").split(" CMD ", 1)[-1]
        for flag in sorted(flags_in(health) - attnctl_flags):
            problem(f"{dockerfile}: HEALTHCHECK passes --{flag}, unknown to attnctl")
        if '"attnctl", "health"' not in health:
            problem(f"{dockerfile}: HEALTHCHECK does not run attnctl health")
        # attnctl health waits up to its --timeout (default 10 s) to
        # connect, then up to --timeout for the check: docker must wait
        # for both.
        options = dockerfile_array(text, "HEALTHCHECK").split(" CMD ", 1)[0]
        docker_wait = re.search(r"--timeout=(\d+)s", options)
        attnctl_wait = re.search(r'"--timeout=(\d+)s"', health)
        wait = int(attnctl_wait.group(1)) if attnctl_wait else 10
        if not docker_wait or int(docker_wait.group(1)) < 2 * wait + 1:
            problem(f"{dockerfile}: HEALTHCHECK --timeout is under twice "
                    f"attnctl's --timeout ({wait} s) + 1")
    for source, flags in sources.items():
        if not flags:
            problem(f"{source}: no flags found")
        for flag in sorted(flags - server_flags - {"flagfile"}):
            problem(f"{os.path.relpath(source, repo)} sets --{flag}, which "
                    "attention-server does not define")
    print(f"attention-server defines {len(server_flags)} flags; checked "
          f"{sum(len(f) for f in sources.values())} uses in {len(sources)} files")

    # 2. attnctl health exit status when nothing listens.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]  # closed again when the block ends
    result = subprocess.run(
        [args.attnctl, "health", f"--target=127.0.0.1:{closed_port}",
         "--timeout=2s"], capture_output=True, text=True, check=False, timeout=60)
    if result.returncode != 2:
        problem(f"attnctl health with no server exited {result.returncode}, "
                f"expected 2 (cannot connect): {result.stderr.strip()}")
    else:
        print("attnctl health with no server exits 2")

    # 3. Runtime libraries of the CPU image.
    result = subprocess.run(
        ["sh", os.path.join(repo, "deploy/docker/runtime-packages.sh"),
         args.server, args.attnctl], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        problem(f"runtime-packages.sh failed: {result.stderr.strip()}")
    else:
        needed = set(result.stdout.split())
        dockerfile = open(os.path.join(repo, "Dockerfile"), encoding="utf-8").read()
        runtime_stage = dockerfile.split("FROM debian:bookworm-slim", 1)[-1]
        install = re.search(r"apt-get install[^&]*", re.sub(r"\\\n", " ", runtime_stage))
        listed = set(install.group(0).split()[2:]) - {"-y", "--no-install-recommends"} \
            if install else set()
        if not listed:
            problem("no apt-get install in the Dockerfile's runtime stage")
        closure = installed_depends_closure(listed)
        missing = sorted(needed - closure)
        if missing:
            problem(f"the Dockerfile's runtime stage lacks {missing} (the "
                    f"binaries load libraries from them)")
        print(f"binaries need {sorted(needed)}; Dockerfile installs "
              f"{sorted(listed)} (+ dependencies)")

    if problems:
        print(f"{len(problems)} problem(s)", file=sys.stderr)
        return 1
    print("deployment files fit the binaries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
