// A gRPC client for contextd over its Unix socket, built from proto/contextd.proto at run time
// (no generated code to keep in step with the proto).
import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";
import type { StatusReply } from "./status.ts";

type UnaryMethod = (
  request: object,
  metadata: grpc.Metadata,
  options: grpc.CallOptions,
  callback: (error: grpc.ServiceError | null, response?: unknown) => void,
) => grpc.ClientUnaryCall;
type StreamMethod = (request: object, options?: grpc.CallOptions) => grpc.ClientReadableStream<unknown>;

const services = new Map<string, grpc.ServiceClientConstructor>();

function contextdService(protoPath: string): grpc.ServiceClientConstructor {
  const cached = services.get(protoPath);
  if (cached) return cached;
  const definition = protoLoader.loadSync(protoPath, {
    keepCase: true, // field names as in the proto (session_id), matching what contextd documents
    longs: Number, // page and token counts stay far below 2^53
    enums: String,
    defaults: true,
    oneofs: true,
  });
  const root = grpc.loadPackageDefinition(definition) as unknown as {
    kv_elision?: { contextd?: { v1?: { Contextd?: grpc.ServiceClientConstructor } } };
  };
  const service = root.kv_elision?.contextd?.v1?.Contextd;
  if (!service) throw new Error(`no service kv_elision.contextd.v1.Contextd in ${protoPath}`);
  services.set(protoPath, service);
  return service;
}

export function connectContextd(protoPath: string, socketPath: string): grpc.Client {
  const Service = contextdService(protoPath);
  return new Service(`unix:${socketPath}`, grpc.credentials.createInsecure());
}

function method<T>(client: grpc.Client, name: string): T {
  const fn = (client as unknown as Record<string, unknown>)[name];
  if (typeof fn !== "function") throw new Error(`contextd has no method ${name}`);
  return (fn as (...args: unknown[]) => unknown).bind(client) as T;
}

export function callContextd<T>(client: grpc.Client, name: string, request: object, timeoutMs = 10_000): Promise<T> {
  const call = method<UnaryMethod>(client, name);
  return new Promise((resolve, reject) => {
    call(request, new grpc.Metadata(), { deadline: Date.now() + timeoutMs }, (error, response) => {
      if (error) reject(error);
      else resolve(response as T);
    });
  });
}

export function watchStatus(
  client: grpc.Client,
  request: { session_id: string; include_closed: boolean },
): grpc.ClientReadableStream<StatusReply> {
  return method<StreamMethod>(client, "WatchStatus")(request) as grpc.ClientReadableStream<StatusReply>;
}
