//! What the request pipeline needs, with no HTTP in it: the tokenizer, the engine replicas, the
//! grammar compiler, the chat output parsers, the metrics and the configuration. `http::AppState`
//! wraps it (adding what only the HTTP layer reads) and derefs to it, so routes hand it to the
//! domain code (`generate`, `constraint`) as `&Frontend`.

use std::sync::Arc;

use tokenspeed_structured::GrammarCompiler;
use tokenspeed_text::TextTokenizer;

use crate::chat_output::ChatParsers;
use crate::config::ServerConfig;
use crate::metrics::Metrics;
use crate::replicas::Replicas;

pub struct Frontend {
    pub config: Arc<ServerConfig>,
    pub tokenizer: Arc<TextTokenizer>,
    /// The engine of each data-parallel replica, behind the router (one without `--dp-size`).
    pub engine: Replicas,
    /// Compiles structured-output grammars against the model's vocabulary (None:
    /// `--grammar-backend none`).
    pub grammar: Option<Arc<GrammarCompiler>>,
    /// The chat output stage's parsers (`--tool-call-parser`, `--reasoning-parser`).
    pub chat_parsers: ChatParsers,
    pub metrics: Arc<Metrics>,
    /// `--enable-trace`: the span exporter (None: off, and nothing is traced).
    pub tracer: Option<crate::otel::Tracer>,
}
