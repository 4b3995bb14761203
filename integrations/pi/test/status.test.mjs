// The status matching of the pi extension, on snapshots shaped as
// proxy/ops/status_types.py writes them. Run: node --test integrations/pi/test/status.test.mjs
import assert from "node:assert/strict";
import { test } from "node:test";

import {
  SseParser,
  follow,
  footerLine,
  formatTokens,
  isStatus,
  newRequestId,
  statusUrl,
  workingLine,
} from "../status.js";

const ID = "pi-0123456789abcdef01234567";

function entry(stage, extra = {}) {
  return {
    id: "chatcmpl-1",
    dialect: "chat",
    endpoint: "/v1/chat/completions",
    stream: true,
    choices: 1,
    stage,
    age_s: 1,
    queue: null,
    prefill: null,
    prompt_tokens: 0,
    cached_tokens: 0,
    completion_tokens: 0,
    decode_tok_s: null,
    ttft_s: null,
    draft_accepted: null,
    draft_rejected: null,
    correlation_id: ID,
    ...extra,
  };
}

function snapshot(...requests) {
  return { object: "status", time: 1, proxy: { in_flight: requests.length }, worker: null, totals: {}, requests };
}

const QUEUED = entry("queued", { queue: { position: 2, queued: 3, waited_s: 1.5, eta_s: null } });
const PREFILL = entry("prefill", {
  prefill: { processed: 12400, total: 29000, cached: 1024, elapsed_s: 3, rate_tok_s: 3800 },
  prompt_tokens: 29000,
  cached_tokens: 1024,
});
const DECODE = entry("decode", { prompt_tokens: 29000, cached_tokens: 1024, completion_tokens: 5 });
const DONE = entry("done", { prompt_tokens: 29000, cached_tokens: 1024, draft_accepted: 40, draft_rejected: 9 });

test("the status URL of each API's base URL", () => {
  assert.equal(statusUrl("http://127.0.0.1:5000/v1"), "http://127.0.0.1:5000/v1/status");
  assert.equal(statusUrl("http://127.0.0.1:5000/v1/"), "http://127.0.0.1:5000/v1/status");
  assert.equal(statusUrl("http://127.0.0.1:5000"), "http://127.0.0.1:5000/v1/status"); // anthropic-messages
  assert.equal(statusUrl("https://host/proxy/v1"), "https://host/proxy/v1/status");
});

test("only a status snapshot is this server", () => {
  assert.ok(isStatus(snapshot()));
  assert.ok(!isStatus({ object: "list", data: [] })); // another server's /v1/models-like answer
  assert.ok(!isStatus({ error: { message: "not found" } }));
  assert.ok(!isStatus(null));
  assert.ok(!isStatus("status"));
});

test("request ids fit the server's safe charset and bound", () => {
  const a = newRequestId();
  assert.match(a, /^pi-[0-9a-f]{24}$/);
  assert.notEqual(a, newRequestId());
});

test("the working line at each stage", () => {
  assert.equal(workingLine(QUEUED), "queued 2 of 3");
  assert.equal(workingLine(PREFILL), "prefill 12,400/29,000 tokens (cached 1,024)");
  assert.equal(workingLine(entry("submitted")), "sent to the worker");
  assert.equal(workingLine(DECODE), undefined); // pi's own spinner once tokens flow
  assert.equal(workingLine(DONE), undefined);
});

test("the footer: cached and draft counts", () => {
  assert.equal(footerLine(QUEUED), undefined); // nothing known before admission
  assert.equal(footerLine(DECODE), "cached 1,024/29,000");
  assert.equal(footerLine(DONE), "cached 1,024/29,000 · drafts 40 accepted, 9 rejected");
  assert.equal(formatTokens(0), "0");
  assert.equal(formatTokens(999), "999");
  assert.equal(formatTokens(1234567), "1,234,567");
});

test("following one request among others", () => {
  const other = { ...QUEUED, correlation_id: "someone-else", queue: { position: 1, queued: 3 } };
  let step = follow(snapshot(other), ID, false);
  assert.deepEqual(step, { found: false, working: undefined, footer: undefined, done: false });
  step = follow(snapshot(other, QUEUED), ID, false);
  assert.equal(step.working, "queued 2 of 3");
  step = follow(snapshot(PREFILL, other), ID, true);
  assert.equal(step.working, "prefill 12,400/29,000 tokens (cached 1,024)");
  assert.equal(step.done, false);
  step = follow(snapshot(DONE), ID, true);
  assert.equal(step.done, true);
  assert.equal(step.footer, "cached 1,024/29,000 · drafts 40 accepted, 9 rejected");
  // Seen, then gone (closed between two snapshots): done, nothing to show.
  assert.deepEqual(follow(snapshot(other), ID, true), { found: false, working: undefined, footer: undefined, done: true });
  // Not a snapshot (an error body): nothing.
  assert.equal(follow({ error: {} }, ID, false).found, false);
});

test("SSE framing: split events, CRLF, comments, multi-line data", () => {
  const sse = new SseParser();
  assert.deepEqual(sse.push("data: {\"a\""), []);
  assert.deepEqual(sse.push(":1}\n\n: ping\n\ndata: x\r\ndata: y\r\n\r\ndata:z\n\n"), ['{"a":1}', "x\ny", "z"]);
  const bounded = new SseParser(8);
  assert.deepEqual(bounded.push("data: 0123456789"), []); // over the bound: dropped
  assert.deepEqual(bounded.push("\n\ndata: ok\n\n"), ["ok"]); // the rest of the dropped event has no data
});
