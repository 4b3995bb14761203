/**
 * exl3-sidecar progress in pi's working line and footer (docs/clients.md: "pi").
 *
 * Before each LLM call (pi's `context` event, which pi awaits before it builds
 * the request) the extension picks a fresh request id and puts it in the
 * environment variable `PI_EXL3_REQUEST_ID` (replaced again once the request is
 * built, `before_provider_request`, so no other call reuses it); the provider's `headers` in
 * `~/.pi/agent/models.json` map `X-Request-Id` to that variable's name, and pi
 * resolves a header's value from the environment at each request
 * (`resolveConfigValueUncached`, pi-coding-agent 0.73.1
 * `dist/core/resolve-config-value.js`), so the request carries the id. The
 * server keeps it as the request's correlation id and lists it in
 * `GET /v1/status` (docs/status.md); the extension follows
 * `/v1/status?stream=true` for that entry and shows `queued 2 of 3`, then
 * `prefill 12,400/29,000 tokens (cached 1,024)`, then pi's own spinner once
 * tokens flow; the footer keeps the last request's cached and draft counts.
 *
 * Only against this server: the first call to a provider's base URL probes
 * `/v1/status` (with the provider's API key, which the server asks for when
 * it has keys) and remembers per base URL and key whether a status snapshot
 * came back; any other provider is left alone (no id, no stream).
 */
import type { ExtensionAPI, ExtensionContext } from "@mariozechner/pi-coding-agent";

import { REQUEST_ID_ENV, SseParser, follow, isStatus, newRequestId, statusUrl } from "./status.js";

const STATUS_KEY = "exl3";
const PROBE_TIMEOUT_MS = 3000;
const INTERVAL_S = 0.25; // the server's fastest status stream
const MAX_FOLLOW_MS = 30 * 60 * 1000; // a status stream is never held longer than this
const NOT_FOUND_MS = 15000; // stop looking for a request the server never listed

type Ui = ExtensionContext["ui"];

function authHeaders(key: string | undefined): Record<string, string> {
  return key ? { Authorization: `Bearer ${key}`, "x-api-key": key } : {};
}

async function probe(url: string, key: string | undefined): Promise<boolean> {
  try {
    const r = await fetch(url, { headers: authHeaders(key), signal: AbortSignal.timeout(PROBE_TIMEOUT_MS) });
    return r.ok && isStatus(await r.json());
  } catch {
    return false;
  }
}

async function followStatus(url: string, key: string | undefined, id: string, ui: Ui, signal: AbortSignal) {
  let seen = false;
  const started = Date.now();
  const stop = AbortSignal.any([signal, AbortSignal.timeout(MAX_FOLLOW_MS)]);
  try {
    const r = await fetch(`${url}?stream=true&interval=${INTERVAL_S}`, { headers: authHeaders(key), signal: stop });
    if (!r.ok || !r.body) return;
    const sse = new SseParser();
    const decoder = new TextDecoder();
    for await (const chunk of r.body as unknown as AsyncIterable<Uint8Array>) {
      for (const data of sse.push(decoder.decode(chunk, { stream: true }))) {
        const step = follow(JSON.parse(data), id, seen);
        seen ||= step.found;
        if (step.found) ui.setWorkingMessage(step.working);
        if (step.footer) ui.setStatus(STATUS_KEY, step.footer);
        if (step.done || (!seen && Date.now() - started > NOT_FOUND_MS)) return;
      }
    }
  } catch {
    // Aborted (the turn ended, a new one began), or the server went away: nothing to show.
  } finally {
    if (!signal.aborted) ui.setWorkingMessage();
  }
}

export default function exl3Progress(pi: ExtensionAPI) {
  const servers = new Map<string, Promise<boolean>>();
  let current: AbortController | undefined;
  let warned = false;

  const stopFollowing = (ui?: Ui) => {
    current?.abort();
    current = undefined;
    ui?.setWorkingMessage();
  };

  pi.on("context", async (_event, ctx) => {
    stopFollowing(ctx.hasUI ? ctx.ui : undefined);
    // Every call gets its own id, print mode too (the header is sent either way).
    const id = newRequestId();
    process.env[REQUEST_ID_ENV] = id;
    const model = ctx.model;
    if (!ctx.hasUI || !model?.baseUrl) return;
    const auth = await ctx.modelRegistry.getApiKeyAndHeaders(model);
    const key = auth.ok ? auth.apiKey : undefined;
    const url = statusUrl(model.baseUrl);
    const known = `${url}\u0000${key ?? ""}`;
    let ours = servers.get(known);
    if (ours === undefined) {
      ours = probe(url, key);
      servers.set(known, ours);
    }
    if (!(await ours)) return;
    const sent = auth.ok ? Object.entries(auth.headers ?? {}).find(([k]) => k.toLowerCase() === "x-request-id") : undefined;
    if (sent?.[1] !== id) {
      if (!warned) {
        warned = true;
        ctx.ui.notify(
          `exl3-sidecar: add "headers": {"X-Request-Id": "${REQUEST_ID_ENV}"} to provider "${model.provider}" ` +
            "in ~/.pi/agent/models.json to see queue and prefill progress",
          "warning",
        );
      }
      return;
    }
    current = new AbortController();
    void followStatus(url, key, id, ctx.ui, current.signal);
  });

  // The request has its headers now: a call that does not pass through `context`
  // (pi's own, such as a compaction summary) gets an id of its own, never this one.
  pi.on("before_provider_request", () => {
    process.env[REQUEST_ID_ENV] = newRequestId();
  });
  pi.on("agent_end", async (_event, ctx) => stopFollowing(ctx.hasUI ? ctx.ui : undefined));
  pi.on("session_shutdown", async () => stopFollowing());
}
