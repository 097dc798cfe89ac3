//! Subscription transformations: a JavaScript `handler(webhook)` whose result is the body
//! sent to the subscription's endpoint (`docs/api.md`, "Transformations").
//!
//! **Why JavaScript on QuickJS.** It is the language people write webhook
//! transformations in elsewhere (Svix, Hookdeck), and QuickJS bounds all three things a
//! hostile or broken script can run away with, in the engine itself: time (an interrupt
//! checked while it runs: [`TIME_LIMIT`]), memory ([`MEMORY_LIMIT`]) and stack depth
//! ([`STACK_LIMIT`]). jq (`jaq`) has none of these: `def f: f; f` overflows the process's
//! stack and aborts the gateway. A short run happens on the calling thread, cut off after
//! a couple of milliseconds; any other on a few threads of their own, one per core
//! ([`run`]); each thread keeps a context warm per script ([`apply`]). A slow script holds
//! a transformation thread, and a thread that serves requests or deliveries at most once
//! for a couple of milliseconds ([`run`]).
//!
//! The webhook a handler gets is the event's document, as filters see it:
//! `{payload, headers, type, source}` (`payload` is null when the body is not JSON). What
//! it returns is sent as JSON (`application/json`), signed like any delivery, under the
//! delivery's `webhook-id`. A script that throws, returns nothing, or breaks a bound makes
//! that delivery dead with the reason; nothing else waits for it.

use std::time::{Duration, Instant};

use rquickjs::{Context, Function, Runtime, Value};

mod alloc;
mod pool;
pub use pool::{run, run_apart};

/// Longest script, in bytes (also a database constraint).
pub const MAX_TRANSFORM_BYTES: usize = 16 * 1024;
/// Longest a run may take.
pub const TIME_LIMIT: Duration = Duration::from_millis(200);
/// Most memory a run may allocate.
pub const MEMORY_LIMIT: usize = 64 << 20;
/// Deepest a run's stack may grow.
pub const STACK_LIMIT: usize = 512 << 10;

/// Check a script when it is saved: it compiles and defines a function `handler`.
pub fn check(script: &str) -> Result<(), String> {
    if script.trim().is_empty() {
        return Err("must not be empty (omit it, or set null, to send the event as it is)".into());
    }
    if script.len() > MAX_TRANSFORM_BYTES {
        return Err(format!("longer than {MAX_TRANSFORM_BYTES} bytes"));
    }
    in_runtime(|ctx| {
        ctx.eval::<(), _>(script)?;
        let handler: Value = ctx.globals().get("handler")?;
        Ok(handler.is_function())
    })
    .and_then(|defined| if defined { Ok(()) } else { Err("defines no function `handler(webhook)`".into()) })
}

/// Run `script`'s `handler` on `webhook` (the event's document) on this thread: the
/// body to send, or why there is none. The gateway calls [`run`], which does this on the
/// transformation threads; this is for them and for tests.
///
/// Contexts are kept warm per thread and per script: creating a JavaScript context costs
/// about 90 µs, more than a whole delivery, so a thread that runs a script again reuses
/// the context it evaluated the script in ([`WARM_SCRIPTS`] scripts per thread, least
/// recently used dropped first; at most [`WARM_RUNS`] runs each, and never after a run
/// that failed: a failure may leave it in any state). The bounds hold per run. A handler
/// therefore must not count on a fresh global scope.
pub fn apply(script: &str, webhook: &Webhook) -> Result<Vec<u8>, String> {
    apply_within(script, webhook, TIME_LIMIT).map_err(|failed| failed.reason)
}

/// Why a run gave no body.
#[derive(Debug)]
pub(crate) struct Failed {
    /// The reason, as a delivery's error shows it.
    pub reason: String,
    /// The run was cut off by its time bound (rather than failing by itself).
    pub timed_out: bool,
}

/// [`apply`] with a time bound of `limit` for this run (the other bounds as always).
pub(crate) fn apply_within(script: &str, webhook: &Webhook, limit: Duration) -> Result<Vec<u8>, Failed> {
    let failed = |reason: String| Failed { reason, timed_out: false };
    WARM.with(|cell| {
        let mut warm = cell.borrow_mut();
        let found = warm.iter().position(|w| w.script == script && w.runs < WARM_RUNS);
        let mut w = match found {
            Some(at) => warm.remove(at),
            None => {
                warm.retain(|w| w.script != script);
                Warm::new(script, limit)?
            }
        };
        w.runs += 1;
        w.arm(limit);
        let started = Instant::now();
        let result = w.context.with(|ctx| {
            let run = || -> rquickjs::Result<Option<String>> {
                let handler: Function = ctx.globals().get("handler")?;
                let input = webhook.to_js(&ctx)?;
                let output: Value = handler.call((input,))?;
                ctx.json_stringify(output)?.map(|s| s.to_string()).transpose()
            };
            run().map_err(|e| match e {
                rquickjs::Error::Exception => {
                    let (reason, timed_out) = describe(&ctx, ctx.catch(), limit);
                    Failed { reason, timed_out }
                }
                other => failed(other.to_string()),
            })
        });
        // The interrupt is only looked at between bytecodes: a native call (a search in a
        // long string) runs past it uninterrupted. A run that took longer than its bound
        // has its answer refused all the same, as cut off.
        let result = match result {
            Ok(_) if started.elapsed() > limit => Err(Failed { reason: ran_longer_than(limit), timed_out: true }),
            other => other,
        };
        // Kept warm only when small: what a script leaves in its global scope stays with
        // its context, and each thread keeps several.
        let small = u64::try_from(w.runtime.memory_usage().malloc_size).is_ok_and(|bytes| bytes <= WARM_MEMORY_MOST);
        if result.is_ok() && small {
            // Most recently used first; the least recently used falls off the end.
            warm.insert(0, w);
            warm.truncate(WARM_SCRIPTS);
        }
        result?
            .map(String::into_bytes)
            .ok_or_else(|| failed("handler returned nothing JSON can hold (undefined or a function)".into()))
    })
}

/// Runs one warm context serves before it is replaced (a handler that leaks into its
/// global scope cannot grow it for ever).
pub const WARM_RUNS: u32 = 1_000;
/// Scripts a thread keeps a warm context for.
pub const WARM_SCRIPTS: usize = 16;
/// Most memory a context may hold after a run to be kept warm: a script that keeps
/// megabytes in its global scope (each run within [`MEMORY_LIMIT`]) would otherwise hold
/// them for up to [`WARM_RUNS`] runs, [`WARM_SCRIPTS`] of them per thread.
pub const WARM_MEMORY_MOST: u64 = 4 * 1024 * 1024;

thread_local! {
    static WARM: std::cell::RefCell<Vec<Warm>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A bounded runtime and a context that has evaluated `script`.
struct Warm {
    script: String,
    // The context before its runtime: fields drop in order, and the context needs the runtime.
    context: Context,
    runtime: Runtime,
    /// When the current run must stop: nanoseconds after `epoch`.
    deadline: std::sync::Arc<std::sync::atomic::AtomicU64>,
    epoch: Instant,
    runs: u32,
}

impl Warm {
    /// A context that has evaluated `script`, the evaluation bounded by `limit` (the run's
    /// own bound: evaluating a script is part of the run that needs its context).
    fn new(script: &str, limit: Duration) -> Result<Warm, Failed> {
        let failed = |reason: String| Failed { reason, timed_out: false };
        let runtime = bounded_runtime().map_err(failed)?;
        let epoch = Instant::now();
        let deadline = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let armed = deadline.clone();
        runtime.set_interrupt_handler(Some(Box::new(move || {
            epoch.elapsed().as_nanos() as u64 > armed.load(std::sync::atomic::Ordering::Relaxed)
        })));
        let context = Context::full(&runtime).map_err(|e| failed(format!("cannot start the script engine: {e}")))?;
        let warm = Warm { script: script.to_owned(), context, runtime, deadline, epoch, runs: 0 };
        warm.arm(limit);
        warm.context.with(|ctx| {
            ctx.eval::<(), _>(script).map_err(|e| match e {
                rquickjs::Error::Exception => {
                    let (reason, timed_out) = describe(&ctx, ctx.catch(), limit);
                    Failed { reason, timed_out }
                }
                other => failed(other.to_string()),
            })
        })?;
        Ok(warm)
    }

    /// Start the clock of one run, which may take up to `limit`.
    fn arm(&self, limit: Duration) {
        let until = (self.epoch.elapsed() + limit).as_nanos() as u64;
        self.deadline.store(until, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The webhook a handler gets: `{payload, headers, type, source}`, in that order.
/// `payload` is the body parsed as it came (the producer's key order, not a map that
/// would sort it), or null when it is not JSON; `headers` is the event's stored headers
/// (JSON text, as the claim reads them), or null.
///
/// **Why built in the engine, not as one JSON text.** The document is put together from
/// its parts inside QuickJS: the body is parsed once, by the engine, straight from a copy
/// of its bytes. A JSON text of the whole document would need the body checked first (a
/// body that is not JSON must not leak into the document around it), then copied into
/// the text, and the text copied again for the engine: three passes over every body
/// instead of one (bench row 15).
#[derive(Debug, Clone)]
pub struct Webhook {
    payload: bytes::Bytes,
    headers: Option<String>,
    event_type: String,
    source: Option<String>,
}

impl Webhook {
    /// The webhook of an event: its body, its stored headers as JSON text, its type and
    /// its source's name.
    pub fn new(payload: bytes::Bytes, headers: Option<String>, event_type: String, source: Option<String>) -> Webhook {
        Webhook { payload, headers, event_type, source }
    }

    /// The bytes a run parses: body and headers.
    pub fn parsed_bytes(&self) -> usize {
        self.payload.len() + self.headers.as_ref().map_or(0, String::len)
    }

    /// The handler's argument, built in `ctx`.
    fn to_js<'js>(&self, ctx: &rquickjs::Ctx<'js>) -> rquickjs::Result<Value<'js>> {
        let document = rquickjs::Object::new(ctx.clone())?;
        let payload = match std::str::from_utf8(&self.payload) {
            Ok(text) => parse_or_null(ctx, text)?,
            Err(_) => Value::new_null(ctx.clone()),
        };
        document.set("payload", payload)?;
        let headers = match &self.headers {
            Some(text) => parse_or_null(ctx, text)?,
            None => Value::new_null(ctx.clone()),
        };
        document.set("headers", headers)?;
        document.set("type", self.event_type.as_str())?;
        let source = match &self.source {
            Some(name) => rquickjs::String::from_str(ctx.clone(), name)?.into_value(),
            None => Value::new_null(ctx.clone()),
        };
        document.set("source", source)?;
        Ok(document.into_value())
    }
}

/// `json` parsed in `ctx`, or null when it is not JSON (a NUL byte, a syntax error). Any
/// other failure (the run's memory or time bound, reached while parsing a huge body) is
/// the run's failure, not a null.
fn parse_or_null<'js>(ctx: &rquickjs::Ctx<'js>, json: &str) -> rquickjs::Result<Value<'js>> {
    let null = || Value::new_null(ctx.clone());
    // The engine needs the text NUL-terminated: room for it, so it is one copy, no more.
    let mut text = Vec::with_capacity(json.len() + 1);
    text.extend_from_slice(json.as_bytes());
    match ctx.json_parse(text) {
        Ok(value) => Ok(value),
        // An interior NUL: not a JSON text.
        Err(rquickjs::Error::InvalidString(_)) => Ok(null()),
        Err(rquickjs::Error::Exception) => {
            let thrown = ctx.catch();
            let syntax = thrown
                .as_exception()
                .and_then(|e| e.get::<_, std::string::String>("name").ok())
                .is_some_and(|name| name == "SyntaxError");
            if syntax { Ok(null()) } else { Err(ctx.throw(thrown)) }
        }
        Err(other) => Err(other),
    }
}

/// A transformation to try (`POST /v1/transforms/test`): a script, and either a stored
/// event or a pasted one.
#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TransformTest {
    /// The script to try (as a subscription's `transform`).
    #[schema(example = "function handler(w) { return {text: `Paid: ${w.payload.amount}`}; }")]
    pub transform: String,
    /// A stored event to try it on.
    #[serde(default)]
    pub event_id: Option<crate::ids::EventId>,
    /// Or an event pasted here.
    #[serde(default)]
    pub event: Option<crate::filters::PastedEvent>,
}

/// What trying a transformation gives: the body it would send, or why there is none.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct TriedTransform {
    /// The body the endpoint would receive (any JSON), when the handler succeeded: as the
    /// handler returned it (a document nested deeper than a parse here would take is
    /// shown, as the worker sends it).
    #[schema(value_type = Option<Object>)]
    pub body: Option<Box<serde_json::value::RawValue>>,
    /// Why there is no body (the reason its delivery would be dead with).
    pub error: Option<String>,
}

/// A runtime on mimalloc ([`alloc`]) within the memory and stack bounds (the time bound
/// is its caller's: an interrupt handler).
/// Why a run cut off after `limit` gave no body, however it was cut off.
fn ran_longer_than(limit: Duration) -> String {
    format!("ran longer than {} ms", limit.as_millis())
}

fn bounded_runtime() -> Result<Runtime, String> {
    let runtime =
        Runtime::new_with_alloc(alloc::MiMalloc).map_err(|e| format!("cannot start the script engine: {e}"))?;
    runtime.set_memory_limit(MEMORY_LIMIT);
    runtime.set_max_stack_size(STACK_LIMIT);
    Ok(runtime)
}

/// Run `f` in a fresh, bounded runtime; a JavaScript exception becomes its message (with
/// where it was thrown).
fn in_runtime<T>(f: impl for<'js> FnOnce(&rquickjs::Ctx<'js>) -> rquickjs::Result<T>) -> Result<T, String> {
    let runtime = bounded_runtime()?;
    let deadline = Instant::now() + TIME_LIMIT;
    runtime.set_interrupt_handler(Some(Box::new(move || Instant::now() > deadline)));
    let context = Context::full(&runtime).map_err(|e| format!("cannot start the script engine: {e}"))?;
    context.with(|ctx| {
        f(&ctx).map_err(|e| match e {
            rquickjs::Error::Exception => describe(&ctx, ctx.catch(), TIME_LIMIT).0,
            other => other.to_string(),
        })
    })
}

/// A thrown value as one line: its message and where (`line:column`), or what it was;
/// and whether it is the interrupt of a run cut off after `limit`.
fn describe<'js>(_ctx: &rquickjs::Ctx<'js>, thrown: Value<'js>, limit: Duration) -> (String, bool) {
    if let Some(exception) = thrown.as_exception() {
        let message = exception.message().unwrap_or_default();
        let timed_out = message == "interrupted";
        let message = if timed_out { ran_longer_than(limit) } else { message };
        let at = exception
            .stack()
            .and_then(|s| s.lines().next().map(|l| l.trim().trim_start_matches("at ").to_owned()))
            .map(|l| format!(" (at {l})"))
            .unwrap_or_default();
        return (format!("{message}{at}"), timed_out);
    }
    (format!("threw {:?}", thrown.type_of()), false)
}

#[cfg(test)]
mod tests {
    use super::*;

    const WEBHOOK: &str = r#"{"id": "ord_1", "amount": 1200, "card": {"number": "4242"}}"#;

    /// A webhook of `payload` (type `order.paid`, no headers, no source).
    fn hook(payload: &str) -> Webhook {
        Webhook::new(bytes::Bytes::copy_from_slice(payload.as_bytes()), None, "order.paid".into(), None)
    }

    #[test]
    fn a_handler_reshapes_the_webhook() {
        let slack = "function handler(w) { return {text: `Order ${w.payload.id} paid: ${w.payload.amount}`}; }";
        assert_eq!(apply(slack, &hook(WEBHOOK)).unwrap(), br#"{"text":"Order ord_1 paid: 1200"}"#);
        let redact = "function handler(w) { delete w.payload.card; return w.payload; }";
        assert_eq!(apply(redact, &hook(WEBHOOK)).unwrap(), br#"{"id":"ord_1","amount":1200}"#);
    }

    /// A run that outlasts its bound inside one native call (the interrupt is looked at
    /// between bytecodes only) is refused as cut off, its answer not used: before, a
    /// search in a long string took 17 s under the 200 ms bound and its delivery was sent.
    #[test]
    fn a_run_past_its_bound_inside_a_native_call_is_refused_as_cut_off() {
        let search = "const s = 'a'.repeat(100000); const needle = 'a'.repeat(200) + 'b'; \
                      function handler(w) { return w.payload.skip ? 0 : s.indexOf(needle); }";
        // Warm: the script evaluated, its strings built.
        assert_eq!(apply(search, &hook(r#"{"skip": true}"#)).unwrap(), b"0");
        let started = Instant::now();
        let ran = apply_within(search, &hook(r#"{"skip": false}"#), Duration::from_millis(1));
        let took = started.elapsed();
        let failed = ran.expect_err("refused");
        assert!(failed.timed_out && failed.reason.contains("ran longer than"), "{failed:?} after {took:?}");
    }

    /// A context whose script keeps megabytes in its global scope is not kept warm; a
    /// small one is.
    #[test]
    fn only_small_contexts_are_kept_warm() {
        let kept = |script: &str| WARM.with(|cell| cell.borrow().iter().any(|w| w.script == script));
        let big = "var big = new Float64Array(2000000).fill(1); function handler(w) { return big.length; }";
        assert_eq!(apply(big, &hook(WEBHOOK)).unwrap(), b"2000000");
        assert!(!kept(big), "16 MB kept warm");
        let small = "function handler(w) { return 1; }";
        assert_eq!(apply(small, &hook(WEBHOOK)).unwrap(), b"1");
        assert!(kept(small));
    }

    /// A body at the default size limit (1 MiB of JSON) fits the memory bound.
    #[test]
    fn a_large_body_fits_the_bounds() {
        let items: Vec<String> =
            (0..20_000).map(|i| format!(r#"{{"sku":"SKU-{i}","qty":{i},"note":"a fairly long note"}}"#)).collect();
        let webhook = hook(&format!(r#"{{"items":[{}]}}"#, items.join(",")));
        assert!(webhook.parsed_bytes() > 1 << 20, "{}", webhook.parsed_bytes());
        let count = "function handler(w) { return {n: w.payload.items.length}; }";
        assert_eq!(apply(count, &webhook).unwrap(), br#"{"n":20000}"#);
    }

    /// A body that is not JSON reaches the handler as null, and the run goes on; a body
    /// whose parse breaks a bound fails the run (it is not taken for "not JSON").
    #[test]
    fn a_body_that_is_not_json_is_null_but_one_too_large_to_parse_fails_the_run() {
        let payload = "function handler(w) { return [w.payload, w.type]; }";
        for body in ["not json", "{\"a\": 1", "{\"a\": \"\0\"}", "{} {}", ""] {
            assert_eq!(apply(payload, &hook(body)).unwrap(), br#"[null,"order.paid"]"#, "{body:?}");
        }
        let not_utf8 = Webhook::new(bytes::Bytes::from_static(b"\"\xff\""), None, "t".into(), None);
        assert_eq!(apply(payload, &not_utf8).unwrap(), br#"[null,"t"]"#);
        // Three million empty objects: a few MiB of text, far more than the memory bound parsed.
        let huge = hook(&format!("[{}]", vec!["{}"; 3_000_000].join(",")));
        let err = apply(payload, &huge).unwrap_err();
        assert!(err.contains("out of memory"), "{err}");
    }

    #[test]
    fn runaway_scripts_are_cut_off_with_the_reason() {
        for (script, why) in [
            ("function handler(w) { while (true) {} }", "ran longer than"),
            ("function handler(w) { let a = []; while (true) a.push(new Array(100000).fill(1)); }", "out of memory"),
            ("function f() { return f(); } function handler(w) { return f(); }", "call stack"),
            ("function handler(w) { throw new Error('no card'); }", "no card"),
            ("function handler(w) { }", "returned nothing"),
        ] {
            let err = apply(script, &hook(WEBHOOK)).unwrap_err();
            assert!(err.contains(why), "{script}: {err}");
        }
    }

    /// A warm context is reused for the same script, kept beside others until it is the
    /// least recently used of too many, and dropped after a failure; the time bound holds
    /// on every run, warm or not.
    #[test]
    fn a_warm_context_keeps_the_bounds_and_is_dropped_after_a_failure() {
        let counter =
            "var n = 0; function handler(w) { n += 1; if (w.payload.boom) throw new Error('boom'); return n; }";
        assert_eq!(apply(counter, &hook("{}")).unwrap(), b"1");
        assert_eq!(apply(counter, &hook("{}")).unwrap(), b"2", "warm: the same context");
        assert!(apply(counter, &hook(r#"{"boom": true}"#)).unwrap_err().contains("boom"));
        assert_eq!(apply(counter, &hook("{}")).unwrap(), b"1", "a fresh context after a failure");
        let slow = "function handler(w) { if (w.payload.spin) { while (true) {} } return 0; }";
        for _ in 0..3 {
            assert_eq!(apply(slow, &hook("{}")).unwrap(), b"0");
        }
        assert!(apply(slow, &hook(r#"{"spin": true}"#)).unwrap_err().contains("ran longer than"));
        assert_eq!(apply(counter, &hook("{}")).unwrap(), b"2", "kept warm beside another script");
        for n in 0..WARM_SCRIPTS {
            let other = format!("function handler(w) {{ return {n}; }}");
            assert_eq!(apply(&other, &hook("{}")).unwrap(), n.to_string().into_bytes());
        }
        assert_eq!(apply(counter, &hook("{}")).unwrap(), b"1", "the least recently used was dropped");
    }

    #[test]
    fn a_script_is_checked_when_saved() {
        assert_eq!(check("function handler(w) { return w; }"), Ok(()));
        assert!(check("function handler(w { ").unwrap_err().contains("eval_script:1:"));
        assert!(check("const x = 1;").unwrap_err().contains("handler"));
        assert!(check("while (true) {}").unwrap_err().contains("ran longer than"));
        assert!(check(" ").is_err());
        assert!(check(&"x".repeat(MAX_TRANSFORM_BYTES + 1)).is_err());
    }

    use proptest::strategy::Strategy;

    proptest::proptest! {
        #![proptest_config(crate::props::config(64))]

        /// Any body, JSON or not, reaches a handler as the producer sent it (parsed) or as
        /// `payload: null`, with the headers, type and source beside it; an identity
        /// handler gives back a document that parses to the same webhook.
        #[test]
        fn any_body_reaches_the_handler_as_sent_or_as_null(
            body in proptest::prop_oneof![
                proptest::collection::vec(proptest::num::u8::ANY, 0..64),
                // JSON objects (numbers JavaScript holds exactly; tests/it/transforms.rs
                // covers every number through the whole gateway).
                proptest::collection::btree_map(
                    "(?s).{0,6}",
                    proptest::prop_oneof![
                        proptest::num::i32::ANY.prop_map(serde_json::Value::from),
                        "(?s).{0,8}".prop_map(serde_json::Value::from),
                        proptest::bool::ANY.prop_map(serde_json::Value::from),
                        proptest::strategy::Just(serde_json::Value::Null),
                    ],
                    0..6,
                )
                .prop_map(|m| serde_json::to_vec(&m).unwrap_or_default()),
            ],
            event_type in "[a-z.]{1,12}",
        ) {
            let headers = serde_json::json!({"x-key": "k"});
            let built = Webhook::new(body.clone().into(), Some(headers.to_string()), event_type.clone(), Some("shop".into()));
            let out = apply("function handler(w) { return w; }", &built).expect("identity");
            let got: serde_json::Value = serde_json::from_slice(&out).expect("JSON");
            let sent = serde_json::from_slice::<serde_json::Value>(&body).unwrap_or(serde_json::Value::Null);
            proptest::prop_assert_eq!(&got["payload"], &sent);
            proptest::prop_assert_eq!(&got["headers"], &headers);
            proptest::prop_assert_eq!(got["type"].as_str(), Some(event_type.as_str()));
            proptest::prop_assert_eq!(got["source"].as_str(), Some("shop"));
        }
    }
}
