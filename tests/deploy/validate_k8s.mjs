// Validates deploy/k8s: renders the Kustomize base and every overlay, then
// checks each rendered object
//   1. against the Kubernetes JSON schemas (kubernetes-models, whose
//      validators are generated from the Kubernetes OpenAPI spec, and the
//      Prometheus Operator's CRD schemas for the ServiceMonitor);
//   2. for unknown fields, as the API server's strict field validation
//      does (a misspelt `readinesProbe` would otherwise pass silently), by
//      walking the object against the models' TypeScript declarations;
//   3. for the wiring that no schema sees: selectors match pod labels,
//      Service target ports and probe ports exist (or the TLS port is
//      probed with attnctl health over TLS), TLS and token files are in
//      mounted Secrets, the ServiceMonitor
//      selects exactly one Service, the drain fits the grace period, the GPU
//      overlay asks for a GPU, the container runs as non-root.
// When `kubectl` is on PATH its `kubectl kustomize` output must equal this
// script's rendering (the renderer below only knows the Kustomize features
// the manifests use, and fails on any other).
//
// Usage: node validate_k8s.mjs --k8s DIR --node-modules DIR
// Exit status: 0 valid, 1 invalid (every problem is printed), 2 usage.
import { execFileSync } from "node:child_process";
import fs from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";

function parseArgs(argv) {
  const args = {};
  for (let i = 2; i < argv.length; i += 2) {
    if (!argv[i].startsWith("--") || i + 1 >= argv.length) {
      console.error(`usage: node validate_k8s.mjs --k8s DIR --node-modules DIR`);
      process.exit(2);
    }
    args[argv[i].slice(2)] = argv[i + 1];
  }
  if (!args.k8s || !args["node-modules"]) {
    console.error(`usage: node validate_k8s.mjs --k8s DIR --node-modules DIR`);
    process.exit(2);
  }
  return args;
}

const args = parseArgs(process.argv);
const k8sDir = path.resolve(args.k8s);
const nodeModules = path.resolve(args["node-modules"]);
const require = createRequire(path.join(nodeModules, "..", "package.json"));
const YAML = require("yaml");

const problems = [];
function problem(where, message) {
  problems.push(`${where}: ${message}`);
}

// ---------------------------------------------------------------------------
// A small Kustomize: resources (files and directories), patches (strategic
// merge, by the patch's kind and name), images. Anything else is an error,
// so that the manifests never rely on a feature rendered wrongly here.

const SUPPORTED_KUSTOMIZATION_KEYS = new Set([
  "apiVersion",
  "kind",
  "resources",
  "patches",
  "images",
]);

function readYamlDocuments(file) {
  const documents = YAML.parseAllDocuments(fs.readFileSync(file, "utf8"));
  const objects = [];
  for (const document of documents) {
    if (document.errors.length > 0) {
      throw new Error(`${file}: ${document.errors[0].message}`);
    }
    const value = document.toJS();
    if (value !== null && value !== undefined) objects.push(value);
  }
  return objects;
}

function isPlainObject(value) {
  return value !== null && typeof value === "object" && !Array.isArray(value);
}

// Strategic merge: maps merge key by key (null deletes), lists of objects
// that all have a `name` merge by name (containers, ports, volumes, env,
// ...), other lists are replaced. These are the merge keys of every list
// the patches here touch.
function strategicMerge(base, patch) {
  if (!isPlainObject(base) || !isPlainObject(patch)) return clone(patch);
  const out = clone(base);
  for (const [key, value] of Object.entries(patch)) {
    if (value === null) {
      delete out[key];
    } else if (isPlainObject(value) && isPlainObject(out[key])) {
      out[key] = strategicMerge(out[key], value);
    } else if (
      Array.isArray(value) &&
      Array.isArray(out[key]) &&
      [...value, ...out[key]].every((item) => isPlainObject(item) && item.name)
    ) {
      const merged = out[key].map(clone);
      for (const item of value) {
        const index = merged.findIndex((existing) => existing.name === item.name);
        if (index >= 0) {
          merged[index] = strategicMerge(merged[index], item);
        } else {
          merged.push(clone(item));
        }
      }
      out[key] = merged;
    } else {
      out[key] = clone(value);
    }
  }
  return out;
}

function clone(value) {
  return value === undefined ? undefined : JSON.parse(JSON.stringify(value));
}

function objectId(object) {
  return `${object.kind}/${object.metadata?.name}`;
}

function podSpecOf(object) {
  if (object.kind === "Pod") return object.spec;
  return object.spec?.template?.spec;
}

function setImages(objects, images, where) {
  for (const image of images) {
    let used = false;
    for (const object of objects) {
      const spec = podSpecOf(object);
      if (!spec) continue;
      for (const container of [
        ...(spec.initContainers ?? []),
        ...(spec.containers ?? []),
      ]) {
        const match = /^([^:@]+)(.*)$/.exec(container.image ?? "");
        if (!match || match[1] !== image.name) continue;
        const name = image.newName ?? match[1];
        const tag =
          image.digest !== undefined
            ? `@${image.digest}`
            : image.newTag !== undefined
              ? `:${image.newTag}`
              : match[2];
        container.image = `${name}${tag}`;
        used = true;
      }
    }
    if (!used) problem(where, `images: no container uses image ${image.name}`);
  }
}

function render(dir) {
  const file = path.join(dir, "kustomization.yaml");
  const [kustomization] = readYamlDocuments(file);
  for (const key of Object.keys(kustomization)) {
    if (!SUPPORTED_KUSTOMIZATION_KEYS.has(key)) {
      throw new Error(
        `${file}: '${key}' is not supported by this test's renderer; ` +
          `extend tests/deploy/validate_k8s.mjs`,
      );
    }
  }
  let objects = [];
  for (const resource of kustomization.resources ?? []) {
    const target = path.join(dir, resource);
    objects.push(
      ...(fs.statSync(target).isDirectory()
        ? render(target)
        : readYamlDocuments(target)),
    );
  }
  for (const entry of kustomization.patches ?? []) {
    if (typeof entry.path !== "string" || Object.keys(entry).length !== 1) {
      throw new Error(`${file}: only 'patches: [{path: FILE}]' is supported`);
    }
    for (const patch of readYamlDocuments(path.join(dir, entry.path))) {
      const index = objects.findIndex(
        (object) =>
          object.kind === patch.kind &&
          object.metadata?.name === patch.metadata?.name,
      );
      if (index < 0) {
        throw new Error(`${entry.path}: patches no resource (${objectId(patch)})`);
      }
      objects[index] = strategicMerge(objects[index], patch);
    }
  }
  setImages(objects, kustomization.images ?? [], file);
  return objects;
}

// ---------------------------------------------------------------------------
// 1. Schemas.

const MODELS = {
  "v1/ConfigMap": "kubernetes-models/v1/ConfigMap",
  "v1/Service": "kubernetes-models/v1/Service",
  "v1/ServiceAccount": "kubernetes-models/v1/ServiceAccount",
  "apps/v1/StatefulSet": "kubernetes-models/apps/v1/StatefulSet",
  "apps/v1/Deployment": "kubernetes-models/apps/v1/Deployment",
  "policy/v1/PodDisruptionBudget":
    "kubernetes-models/policy/v1/PodDisruptionBudget",
  "monitoring.coreos.com/v1/ServiceMonitor":
    "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor",
};

function modelModule(object) {
  return MODELS[`${object.apiVersion}/${object.kind}`];
}

function validateSchema(object, where) {
  const module = modelModule(object);
  if (!module) {
    problem(where, `no schema known for ${object.apiVersion} ${object.kind}`);
    return;
  }
  const Model = require(module)[object.kind];
  try {
    new Model(object).validate();
  } catch (error) {
    problem(where, `schema: ${error.message}`);
  }
}

// ---------------------------------------------------------------------------
// 2. Unknown fields, from the TypeScript declarations of the same models.

let typeChecker = null;
const rootTypes = new Map();

function declarationFile(module) {
  const resolved = require.resolve(module);  // .../Kind.js
  return resolved.replace(/\.c?js$/, ".d.ts");
}

function loadTypes(objects) {
  const ts = require("typescript");
  const files = [...new Set(objects.map(modelModule).filter(Boolean))].map(
    (module) => [module, declarationFile(module)],
  );
  const program = ts.createProgram(
    files.map(([, file]) => file),
    {
      noEmit: true,
      skipLibCheck: true,
      types: [],
      module: ts.ModuleKind.CommonJS,
      moduleResolution: ts.ModuleResolutionKind.Node10,
    },
  );
  typeChecker = program.getTypeChecker();
  for (const [module, file] of files) {
    const source = program.getSourceFile(file);
    const kind = module.split("/").pop();
    // The `I<Kind>` interface declares the object's fields.
    const declaration = source.statements.find(
      (statement) =>
        ts.isInterfaceDeclaration(statement) &&
        statement.name.text === `I${kind}`,
    );
    if (!declaration) throw new Error(`${file}: no interface I${kind}`);
    rootTypes.set(module, typeChecker.getTypeAtLocation(declaration.name));
  }
  return ts;
}

function checkFields(ts, value, type, where) {
  type = typeChecker.getNonNullableType(type);
  if (Array.isArray(value)) {
    const element = typeChecker.getIndexTypeOfType(type, ts.IndexKind.Number);
    if (element) value.forEach((item, i) => checkFields(ts, item, element, `${where}[${i}]`));
    return;
  }
  if (!isPlainObject(value)) return;
  const members = type.isUnion() ? type.types : [type];
  for (const [key, child] of Object.entries(value)) {
    let childType = null;
    let known = false;
    for (const member of members) {
      const property = member.getProperty(key);
      if (property) {
        known = true;
        childType = typeChecker.getTypeOfSymbol(property);
        break;
      }
      const index = typeChecker.getIndexTypeOfType(member, ts.IndexKind.String);
      if (index) {
        known = true;
        childType = index;
        break;
      }
    }
    if (!known) {
      problem(where, `unknown field '${key}'`);
    } else if (childType) {
      checkFields(ts, child, childType, `${where}.${key}`);
    }
  }
}

// ---------------------------------------------------------------------------
// 3. Wiring.

function matches(selector, labels) {
  return Object.entries(selector ?? {}).every(([k, v]) => labels?.[k] === v);
}

function flagsOf(configMap) {
  const flags = {};
  for (const text of Object.values(configMap?.data ?? {})) {
    for (const line of text.split("\n")) {
      const match = /^\s*--([A-Za-z0-9_]+)(?:=(.*))?\s*$/.exec(line);
      if (match) flags[match[1]] = match[2] ?? "true";
    }
  }
  return flags;
}

function durationSeconds(text) {
  let total = 0;
  const units = { h: 3600, m: 60, s: 1, ms: 1e-3 };
  const re = /(\d+(?:\.\d+)?)(ms|h|m|s)/g;
  let match;
  let consumed = "";
  while ((match = re.exec(text)) !== null) {
    total += Number(match[1]) * units[match[2]];
    consumed += match[0];
  }
  return consumed === text ? total : NaN;
}

function checkWiring(name, objects) {
  const byKind = (kind) => objects.filter((object) => object.kind === kind);
  const workloads = [...byKind("StatefulSet"), ...byKind("Deployment")];
  if (workloads.length !== 1) {
    problem(name, `expected one workload, found ${workloads.length}`);
    return;
  }
  const workload = workloads[0];
  const where = `${name} ${objectId(workload)}`;
  const template = workload.spec.template;
  const pod = template.spec;
  const podLabels = template.metadata?.labels ?? {};
  if (!matches(workload.spec.selector?.matchLabels, podLabels)) {
    problem(where, "selector does not match the pod template labels");
  }
  const container = pod.containers.find((c) => c.name === "attention-server");
  if (!container) {
    problem(where, "no container named attention-server");
    return;
  }
  const portNames = new Map(
    (container.ports ?? []).map((port) => [port.name, port.containerPort]),
  );
  for (const wanted of ["grpc", "metrics"]) {
    if (!portNames.has(wanted)) problem(where, `no container port '${wanted}'`);
  }
  const grpcPort = portNames.get("grpc");
  // Probes: native gRPC probes on the gRPC port, or (the port speaking TLS,
  // which native probes cannot) `attnctl health` against it over TLS.
  const healthProbes = [];
  for (const probe of ["startupProbe", "readinessProbe", "livenessProbe"]) {
    // The API server refuses a probe with more than one handler (a patch
    // that adds one merges next to the base's).
    const handlers = ["exec", "grpc", "httpGet", "tcpSocket"].filter(
      (handler) => container[probe]?.[handler] !== undefined,
    );
    if (handlers.length > 1) {
      problem(where, `${probe} has ${handlers.length} handlers (${handlers.join(", ")})`);
    }
    const command = container[probe]?.exec?.command;
    if (command) {
      healthProbes.push({ probe, command, timeout: container[probe].timeoutSeconds ?? 1 });
      continue;
    }
    const port = container[probe]?.grpc?.port;
    if (port === undefined) {
      problem(where, `${probe} is neither a native gRPC probe nor attnctl health`);
    } else if (port !== grpcPort) {
      problem(where, `${probe} probes port ${port}, gRPC is on ${grpcPort}`);
    }
  }
  if (workload.kind === "StatefulSet") {
    const governing = byKind("Service").find(
      (service) => service.metadata.name === workload.spec.serviceName,
    );
    if (!governing) {
      problem(where, `serviceName ${workload.spec.serviceName} is not a Service here`);
    } else if (governing.spec.clusterIP !== "None") {
      problem(where, `governing Service ${governing.metadata.name} is not headless`);
    }
  }

  // Flags: the ConfigMap mounted and passed with --flagfile.
  const flagVolume = (pod.volumes ?? []).find((volume) => volume.configMap);
  const configMap = byKind("ConfigMap").find(
    (map) => map.metadata.name === flagVolume?.configMap?.name,
  );
  if (!configMap) {
    problem(where, "no ConfigMap volume with the flags");
  }
  const mount = (container.volumeMounts ?? []).find(
    (m) => m.name === flagVolume?.name,
  );
  const flagfileArg = (container.args ?? []).find((arg) =>
    arg.startsWith("--flagfile="),
  );
  const flagfile = flagfileArg?.slice("--flagfile=".length);
  if (!mount || !flagfile || path.dirname(flagfile) !== mount.mountPath ||
      !(path.basename(flagfile) in (configMap?.data ?? {}))) {
    problem(where, "--flagfile does not name a file of the mounted ConfigMap");
  }
  const flags = flagsOf(configMap);
  if (Number(flags.port) !== grpcPort) {
    problem(where, `--port=${flags.port} but the grpc container port is ${grpcPort}`);
  }
  if (Number(flags.metrics_port) !== portNames.get("metrics")) {
    problem(where, `--metrics_port=${flags.metrics_port} but the metrics container port is ${portNames.get("metrics")}`);
  }
  const tls = flags.tls_cert_file !== undefined;
  for (const { probe, command, timeout } of healthProbes) {
    const target = command.find((arg) => arg.startsWith("--target="));
    // attnctl health waits up to --timeout (default 10 s) to connect, then
    // up to --timeout for the check: the kubelet must wait for both.
    const waitArg = command.find((arg) => arg.startsWith("--timeout="));
    const wait = waitArg ? durationSeconds(waitArg.slice("--timeout=".length)) : 10;
    if (!(timeout >= 2 * wait + 1)) {
      problem(where, `${probe}: timeoutSeconds ${timeout} is under twice attnctl's --timeout (${wait} s) + 1`);
    }
    if (command[0] !== "attnctl" || command[1] !== "health") {
      problem(where, `${probe} runs ${command.join(" ")}, not attnctl health`);
    } else if (!target || Number(target.split(":").pop()) !== grpcPort) {
      problem(where, `${probe}: attnctl health must target the gRPC port ${grpcPort}`);
    } else if (tls && !command.some((arg) => arg.startsWith("--tls"))) {
      problem(where, `${probe}: the gRPC port speaks TLS but the probe does not`);
    } else if (!tls && command.some((arg) => arg.startsWith("--tls"))) {
      problem(where, `${probe}: the probe speaks TLS but the server has no --tls_cert_file`);
    }
  }
  if (healthProbes.length > 0 && !tls) {
    problem(where, "without TLS use native gRPC probes");
  }
  // Files the flags name must lie in a mounted volume.
  for (const flag of ["tls_cert_file", "tls_key_file", "tls_client_ca_file",
                      "auth_tokens_file"]) {
    if (flags[flag] === undefined) continue;
    const dir = path.dirname(flags[flag]);
    const mounted = (container.volumeMounts ?? []).find((m) => m.mountPath === dir);
    const volume = (pod.volumes ?? []).find((v) => v.name === mounted?.name);
    if (!volume?.secret) {
      problem(where, `--${flag}=${flags[flag]} is not in a mounted Secret`);
    } else if (mounted.subPath) {
      problem(where, `--${flag}: a subPath mount never sees Secret updates`);
    }
  }
  // The drain, then the metrics linger, must end before the grace period
  // does and before the liveness probe (failing once gRPC stops) kills it.
  const drain = durationSeconds(flags.drain_timeout ?? "");
  const linger = flags.metrics_linger === undefined
    ? 0 : durationSeconds(flags.metrics_linger);
  const grace = pod.terminationGracePeriodSeconds;
  if (!(drain > 0)) {
    problem(where, `--drain_timeout missing or unparsable: ${flags.drain_timeout}`);
  } else if (!(linger >= 0)) {
    problem(where, `--metrics_linger unparsable: ${flags.metrics_linger}`);
  } else if (!(grace > drain + linger)) {
    problem(where, `terminationGracePeriodSeconds ${grace} must exceed ` +
                   `--drain_timeout ${drain}s + --metrics_linger ${linger}s`);
  }
  const liveness = container.livenessProbe;
  if (liveness && liveness.periodSeconds * liveness.failureThreshold <= drain + linger) {
    problem(where, "the liveness probe could kill a pod before its drain and metrics linger end");
  }

  // Security.
  const securityContext = { ...pod.securityContext, ...container.securityContext };
  if (securityContext.runAsNonRoot !== true || !(securityContext.runAsUser > 0)) {
    problem(where, "must run as a non-root user (runAsNonRoot, runAsUser > 0)");
  }
  if (container.securityContext?.allowPrivilegeEscalation !== false) {
    problem(where, "allowPrivilegeEscalation must be false");
  }
  for (const kind of ["requests", "limits"]) {
    for (const resource of ["cpu", "memory"]) {
      if (container.resources?.[kind]?.[resource] === undefined) {
        problem(where, `resources.${kind}.${resource} missing`);
      }
    }
  }

  // Services.
  for (const service of byKind("Service")) {
    const at = `${name} ${objectId(service)}`;
    if (!matches(service.spec.selector, podLabels)) {
      problem(at, "selector does not match the pods");
    }
    for (const port of service.spec.ports) {
      const target = port.targetPort ?? port.port;
      if (typeof target === "string" ? !portNames.has(target)
                                     : ![...portNames.values()].includes(target)) {
        problem(at, `port ${port.name} targets ${target}, not a container port`);
      }
    }
  }
  for (const budget of byKind("PodDisruptionBudget")) {
    if (!matches(budget.spec.selector?.matchLabels, podLabels)) {
      problem(`${name} ${objectId(budget)}`, "selector does not match the pods");
    }
  }
  for (const monitor of byKind("ServiceMonitor")) {
    const at = `${name} ${objectId(monitor)}`;
    const selected = byKind("Service").filter((service) =>
      matches(monitor.spec.selector?.matchLabels, service.metadata.labels),
    );
    if (selected.length !== 1) {
      problem(at, `selects ${selected.length} Services; exactly one avoids duplicate scrapes`);
      continue;
    }
    const service = selected[0];
    for (const endpoint of monitor.spec.endpoints) {
      if (!service.spec.ports.some((port) => port.name === endpoint.port)) {
        problem(at, `endpoint port ${endpoint.port} is not a port of ${service.metadata.name}`);
      }
    }
    // The alert rules and dashboards select job="attention-server".
    const job = monitor.spec.jobLabel
      ? service.metadata.labels?.[monitor.spec.jobLabel]
      : service.metadata.name;
    if (job !== "attention-server") {
      problem(at, `scrapes as job ${job}; the alert rules expect attention-server`);
    }
    // A terminating pod must stay a target through its drain and metrics
    // linger, or its final counts are never scraped.
    if (flags.metrics_linger !== undefined && !service.spec.publishNotReadyAddresses) {
      problem(at, `--metrics_linger is set but ${service.metadata.name} drops ` +
                  "terminating pods (publishNotReadyAddresses)");
    }
  }
  return { container, flags };
}

// ---------------------------------------------------------------------------

function canonical(objects) {
  const sortKeys = (value) =>
    Array.isArray(value)
      ? value.map(sortKeys)
      : isPlainObject(value)
        ? Object.fromEntries(
            Object.keys(value).sort().map((key) => [key, sortKeys(value[key])]),
          )
        : value;
  return objects
    .map((object) => [objectId(object), JSON.stringify(sortKeys(object))])
    .sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0));
}

function kubectlAvailable() {
  try {
    execFileSync("kubectl", ["version", "--client"], { stdio: "ignore" });
    return true;
  } catch {
    return false;
  }
}

const targets = [
  ["base", path.join(k8sDir, "base")],
  ...fs
    .readdirSync(path.join(k8sDir, "overlays"))
    .sort()
    .map((overlay) => [`overlays/${overlay}`, path.join(k8sDir, "overlays", overlay)]),
];

const rendered = new Map();
for (const [name, dir] of targets) {
  try {
    rendered.set(name, render(dir));
  } catch (error) {
    problem(name, `cannot render: ${error.message}`);
  }
}
const allObjects = [...rendered.values()].flat();
const ts = loadTypes(allObjects);
let checked = 0;
const wiring = new Map();
for (const [name, objects] of rendered) {
  const ids = objects.map(objectId);
  if (new Set(ids).size !== ids.length) problem(name, "duplicate objects");
  for (const object of objects) {
    const where = `${name} ${objectId(object)}`;
    validateSchema(object, where);
    const module = modelModule(object);
    if (module) checkFields(ts, object, rootTypes.get(module), where);
    ++checked;
  }
  wiring.set(name, checkWiring(name, objects));
}

// Overlay-specific expectations.
const gpu = wiring.get("overlays/gpu");
if (gpu?.container) {
  const limits = gpu.container.resources?.limits ?? {};
  if (Number(limits["nvidia.com/gpu"]) !== 1) {
    problem("overlays/gpu", "the container must have limits nvidia.com/gpu: 1");
  }
  if (!/cuda/.test(gpu.container.image)) {
    problem("overlays/gpu", `image ${gpu.container.image} is not the CUDA image`);
  }
  if (gpu.flags.backend !== "cuda") {
    problem("overlays/gpu", `--backend=${gpu.flags.backend}, expected cuda`);
  }
}
const cpu = wiring.get("overlays/cpu");
if (cpu?.container) {
  if (cpu.container.resources?.limits?.["nvidia.com/gpu"] !== undefined) {
    problem("overlays/cpu", "the CPU overlay must not ask for a GPU");
  }
  if (cpu.flags.backend !== "cpu") {
    problem("overlays/cpu", `--backend=${cpu.flags.backend}, expected cpu`);
  }
}

if (kubectlAvailable()) {
  for (const [name, dir] of targets) {
    if (!rendered.has(name)) continue;
    const output = execFileSync("kubectl", ["kustomize", dir], { encoding: "utf8" });
    const theirs = canonical(YAML.parseAllDocuments(output).map((d) => d.toJS()));
    const ours = canonical(rendered.get(name));
    if (JSON.stringify(theirs) !== JSON.stringify(ours)) {
      problem(name, "this test's rendering differs from `kubectl kustomize`");
      console.error(`kubectl: ${JSON.stringify(theirs, null, 1)}`);
      console.error(`ours:    ${JSON.stringify(ours, null, 1)}`);
    }
  }
  console.log("renderings match `kubectl kustomize`");
} else {
  console.log("kubectl not installed: rendering not compared with kubectl kustomize");
}

if (problems.length > 0) {
  for (const line of problems) console.error(`INVALID ${line}`);
  console.error(`${problems.length} problem(s) in ${checked} rendered objects`);
  process.exit(1);
}
console.log(
  `${checked} rendered objects in ${rendered.size} kustomizations ` +
    `(${[...rendered.keys()].join(", ")}) are valid`,
);
