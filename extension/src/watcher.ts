// Feeds the status line from contextd's WatchStatus stream (one reply per commit). The stream
// is expected to drop (contextd restarts, is killed, was never started): the watcher then shows
// where it looked and reconnects with capped exponential backoff, never throwing into Pi.
import * as grpc from "@grpc/grpc-js";
import { connectContextd, watchStatus } from "./contextd.ts";
import { downText, statusText, type StatusReply } from "./status.ts";

export interface WatcherOptions {
  socketPath: string;
  protoPath: string;
  sessionId: string;
  onText: (text: string) => void;
  minBackoffMs?: number;
  maxBackoffMs?: number;
}

export class StatusWatcher {
  private readonly minBackoffMs: number;
  private readonly maxBackoffMs: number;
  private backoffMs: number;
  private client: grpc.Client | undefined;
  private call: grpc.ClientReadableStream<StatusReply> | undefined;
  private timer: NodeJS.Timeout | undefined;
  private stopped = false;
  private lastText: string | undefined;

  constructor(private readonly options: WatcherOptions) {
    this.minBackoffMs = options.minBackoffMs ?? 250;
    this.maxBackoffMs = options.maxBackoffMs ?? 5000;
    this.backoffMs = this.minBackoffMs;
  }

  start(): void {
    this.stopped = false;
    this.connect();
  }

  stop(): void {
    this.stopped = true;
    if (this.timer) clearTimeout(this.timer);
    this.timer = undefined;
    this.teardown();
  }

  // WatchStatus answers on every commit, most of which leave the line unchanged; only changes
  // reach Pi (in RPC mode each one is a line on stdout).
  private show(text: string): void {
    if (this.stopped || text === this.lastText) return;
    this.lastText = text;
    this.options.onText(text);
  }

  private teardown(): void {
    const { call, client } = this;
    this.call = undefined;
    this.client = undefined;
    call?.removeAllListeners();
    call?.on("error", () => {}); // a cancelled call still reports CANCELLED; nothing to do with it
    call?.cancel();
    client?.close();
  }

  private connect(): void {
    if (this.stopped) return;
    let client: grpc.Client;
    try {
      client = connectContextd(this.options.protoPath, this.options.socketPath);
    } catch (error) {
      // A missing or broken proto will not fix itself; say so and stop trying.
      this.show(`kv status unavailable: ${error instanceof Error ? error.message : String(error)}`);
      return;
    }
    // Every open session, filtered here: asking for one session fails with NOT_FOUND until the
    // server opens it on the first request, and again if it is deleted while watched.
    const call = watchStatus(client, { session_id: "", include_closed: false });
    this.client = client;
    this.call = call;
    let dropped = false;
    const drop = (text: string): void => {
      if (dropped || this.call !== call) return;
      dropped = true;
      this.show(text);
      this.teardown();
      this.schedule();
    };
    call.on("data", (reply: StatusReply) => {
      this.backoffMs = this.minBackoffMs;
      this.show(statusText(reply, this.options.sessionId));
    });
    call.on("error", (error: grpc.ServiceError) => drop(this.errorText(error)));
    call.on("end", () => drop(downText(this.options.socketPath)));
  }

  private errorText(error: grpc.ServiceError): string {
    if (error.code === grpc.status.UNAVAILABLE) return downText(this.options.socketPath);
    const code = grpc.status[error.code] ?? String(error.code);
    return `kv contextd error ${code}: ${error.details || error.message}`;
  }

  private schedule(): void {
    if (this.stopped) return;
    const delay = this.backoffMs;
    this.backoffMs = Math.min(this.backoffMs * 2, this.maxBackoffMs);
    this.timer = setTimeout(() => {
      this.timer = undefined;
      this.connect();
    }, delay);
    // The watcher must never be what keeps Pi's process alive.
    this.timer.unref();
  }
}
