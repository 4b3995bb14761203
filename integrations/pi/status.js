// @ts-check
/**
 * What the pi extension reads from exl3-sidecar's `GET /v1/status` (docs/status.md),
 * kept apart from pi's API so that node's own test runner checks it with no
 * dependency (`node --test integrations/pi/test/status.test.mjs`).
 *
 * A snapshot is `{"object": "status", "proxy": {...}, "worker": {...} | null,
 * "requests": [RequestStatus, ...]}`; each request carries `correlation_id`: the
 * client's `X-Request-Id` (sanitized by the server: letters, digits and
 * `-_.:/+=@`, at most 128 characters), which is how the extension finds the
 * request it sent.
 */

/** The environment variable pi resolves the `X-Request-Id` header from (docs/clients.md). */
export const REQUEST_ID_ENV = "PI_EXL3_REQUEST_ID";

/**
 * `GET /v1/status` of the server behind a pi provider's `baseUrl`: OpenAI
 * providers end it with `/v1`, Anthropic's does not.
 * @param {string} baseUrl
 * @returns {string}
 */
export function statusUrl(baseUrl) {
  const base = baseUrl.replace(/\/+$/, "").replace(/\/v1$/, "");
  return `${base}/v1/status`;
}

/**
 * Whether `body` (a decoded JSON answer) is an exl3-sidecar status snapshot: how
 * the extension tells this server from any other provider.
 * @param {unknown} body
 * @returns {boolean}
 */
export function isStatus(body) {
  if (typeof body !== "object" || body === null) return false;
  const b = /** @type {Record<string, unknown>} */ (body);
  return b.object === "status" && typeof b.proxy === "object" && b.proxy !== null && Array.isArray(b.requests);
}

/**
 * A fresh request id: `pi-` and 24 hex digits (within the server's safe charset).
 * @returns {string}
 */
export function newRequestId() {
  const bytes = new Uint8Array(12);
  globalThis.crypto.getRandomValues(bytes);
  return `pi-${Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("")}`;
}

/**
 * The entry of the request tagged `id` in `snapshot`, if listed.
 * @param {any} snapshot
 * @param {string} id
 * @returns {any | undefined}
 */
export function findRequest(snapshot, id) {
  if (!isStatus(snapshot)) return undefined;
  return snapshot.requests.find((/** @type {any} */ r) => r && r.correlation_id === id);
}

/**
 * Thousands with commas, as pi's footer writes counts: 12400 -> "12,400".
 * @param {number} n
 * @returns {string}
 */
export function formatTokens(n) {
  return Math.round(n).toString().replace(/\B(?=(\d{3})+(?!\d))/g, ",");
}

/**
 * The working line for a request's entry: where it is before its first token
 * (`queued 2 of 3`, `prefill 12,400/29,000 tokens (cached 1,024)`), `undefined`
 * once tokens flow (pi's own spinner and message then).
 * @param {any} entry
 * @returns {string | undefined}
 */
export function workingLine(entry) {
  if (!entry) return undefined;
  switch (entry.stage) {
    case "submitted":
      return "sent to the worker";
    case "queued": {
      const q = entry.queue;
      return q ? `queued ${q.position} of ${q.queued}` : "queued";
    }
    case "prefill": {
      const p = entry.prefill;
      if (!p) return "prefill";
      return `prefill ${formatTokens(p.processed)}/${formatTokens(p.total)} tokens (cached ${formatTokens(p.cached)})`;
    }
    default:
      return undefined;
  }
}

/**
 * The footer's text for the last request: its cached prompt tokens and its
 * draft counts (`null` draft counts: drafting off, or not reported yet).
 * @param {any} entry
 * @returns {string | undefined}
 */
export function footerLine(entry) {
  if (!entry || !entry.prompt_tokens) return undefined;
  const cached = `cached ${formatTokens(entry.cached_tokens)}/${formatTokens(entry.prompt_tokens)}`;
  if (entry.draft_accepted === null || entry.draft_accepted === undefined) return cached;
  const drafts = `drafts ${formatTokens(entry.draft_accepted)} accepted, ${formatTokens(entry.draft_rejected ?? 0)} rejected`;
  return `${cached} · ${drafts}`;
}

/**
 * Server-Sent Events to data payloads: `push` each decoded chunk, get the
 * `data:` of every event completed by it (multi-line data joined with "\n";
 * comments such as `: ping` and other fields skipped). Bounded: an event over
 * `maxEventChars` is dropped whole.
 */
export class SseParser {
  /** @param {number} [maxEventChars] */
  constructor(maxEventChars = 4 * 1024 * 1024) {
    this.buffer = "";
    this.maxEventChars = maxEventChars;
  }

  /**
   * @param {string} text
   * @returns {string[]}
   */
  push(text) {
    this.buffer += text.replace(/\r\n?/g, "\n");
    /** @type {string[]} */
    const out = [];
    let end;
    while ((end = this.buffer.indexOf("\n\n")) >= 0) {
      const event = this.buffer.slice(0, end);
      this.buffer = this.buffer.slice(end + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(line.startsWith("data: ") ? 6 : 5));
      if (data.length) out.push(data.join("\n"));
    }
    if (this.buffer.length > this.maxEventChars) this.buffer = "";
    return out;
  }
}

/**
 * What one snapshot means for the request tagged `id`, given whether it was
 * seen in an earlier one: `working` (the line to show, `undefined`: pi's own),
 * `footer` (when the entry has counts), `done` (it was seen and is gone, or
 * it reached its tokens: nothing more to show than the footer).
 * @param {any} snapshot
 * @param {string} id
 * @param {boolean} seen
 * @returns {{ found: boolean, working: string | undefined, footer: string | undefined, done: boolean }}
 */
export function follow(snapshot, id, seen) {
  const entry = findRequest(snapshot, id);
  if (!entry) return { found: false, working: undefined, footer: undefined, done: seen };
  return { found: true, working: workingLine(entry), footer: footerLine(entry), done: entry.stage === "done" };
}
