//! The server span of a generating request (`--enable-trace`; the layer is absent without it):
//! opened before admission, a child of the request's W3C `traceparent`, ended when the
//! response body ends (a stream lives past its handler). The handler's future runs with the
//! span's context attached (`FutureExt::with_context`), which is how `generate` finds the
//! request's trace without a parameter on every route. The response carries the trace in a
//! `traceresponse` header (W3C Trace Context level 2), so a client can look its trace up.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;
use futures_util::StreamExt;
use opentelemetry::context::FutureExt as _;
use opentelemetry::propagation::Extractor;
use opentelemetry::trace::{Status, TraceContextExt};
use opentelemetry::{Context, KeyValue};

use super::AppState;

pub async fn trace_request(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let Some(tracer) = state.tracer.as_ref() else {
        return next.run(req).await;
    };
    let name = format!("{} {}", req.method(), req.uri().path());
    let cx = tracer.server_span(&HeaderExtractor(req.headers()), name);
    let span = cx.span();
    span.set_attributes([
        KeyValue::new("http.request.method", req.method().to_string()),
        KeyValue::new("url.path", req.uri().path().to_string()),
    ]);
    let ids = span.span_context().clone();
    let response = next.run(req).with_context(cx.clone()).await;
    let status = response.status();
    span.set_attribute(KeyValue::new(
        "http.response.status_code",
        i64::from(status.as_u16()),
    ));
    if status.is_server_error() {
        span.set_status(Status::error(status.to_string()));
    }
    let (mut parts, body) = response.into_parts();
    let flags = if ids.is_sampled() { "01" } else { "00" };
    let value = format!("00-{}-{}-{flags}", ids.trace_id(), ids.span_id());
    if let Ok(v) = HeaderValue::from_str(&value) {
        parts.headers.insert("traceresponse", v);
    }
    let ender = EndOnDrop(cx);
    let body = body.into_data_stream().map(move |frame| {
        let _held = &ender;
        frame
    });
    Response::from_parts(parts, Body::from_stream(body))
}

/// The request's headers, as the W3C propagator reads them.
struct HeaderExtractor<'a>(&'a axum::http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// Ends the server span when the response body is done with (sent in full or dropped).
struct EndOnDrop(Context);

impl Drop for EndOnDrop {
    fn drop(&mut self) {
        let now = crate::otel::wall_time(std::time::Instant::now());
        self.0.span().end_with_timestamp(now);
    }
}
