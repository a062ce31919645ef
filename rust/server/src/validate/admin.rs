//! The operations routes' own fields (SGLang's RL hooks and vLLM's LoRA routes): pausing,
//! weights from disk, memory release, adapters. Their handlers (`http/ops.rs`, `http/lora.rs`)
//! run what these checks let through.

use crate::error::RequestError;
use crate::lora::{Adapter, LoraError};

/// `/pause_generation`'s `mode`: whether the requests in flight are aborted (SGLang's default)
/// or stay where they are until `/continue_generation`.
pub fn pause_aborts(mode: Option<&str>) -> Result<bool, RequestError> {
    match mode {
        None | Some("abort") => Ok(true),
        Some("in_place") => Ok(false),
        Some("retract") => Err(RequestError::bad_param(
            "mode",
            "mode 'retract' is not supported yet: use 'in_place' (requests keep their KV) or \
             'abort'",
        )),
        Some(other) => Err(RequestError::bad_param(
            "mode",
            format!("unknown mode {other:?} (expected \"abort\" or \"in_place\")"),
        )),
    }
}

/// `/update_weights_from_disk`'s fields, as the worker op's arguments (a JSON object).
pub fn weight_update(
    model_path: &str,
    load_format: Option<&str>,
    flush_cache: Option<bool>,
) -> Result<Vec<u8>, RequestError> {
    if flush_cache == Some(false) {
        return Err(RequestError::bad_param(
            "flush_cache",
            "flush_cache false is not supported yet: the old weights' KV would be reused",
        ));
    }
    if model_path.is_empty() {
        return Err(RequestError::bad_param("model_path", "model_path is empty"));
    }
    let args = serde_json::json!({"model_path": model_path, "load_format": load_format})
        .to_string()
        .into_bytes();
    if args.len() > tokenspeed_engine::MAX_OP_TEXT {
        return Err(RequestError::bad_param(
            "model_path",
            "model_path is too long",
        ));
    }
    Ok(args)
}

/// The tags SGLang's memory routes take: all of "weights" and "kv_cache" (and "cuda_graph").
pub fn memory_tags(tags: &[String]) -> Result<(), RequestError> {
    const KNOWN: [&str; 3] = ["weights", "kv_cache", "cuda_graph"];
    if let Some(bad) = tags.iter().find(|t| !KNOWN.contains(&t.as_str())) {
        return Err(RequestError::bad_param(
            "tags",
            format!("unknown memory tag {bad:?} (weights, kv_cache, cuda_graph)"),
        ));
    }
    let has = |t: &str| tags.iter().any(|x| x == t);
    if !(has("weights") && has("kv_cache")) {
        return Err(RequestError::bad_param(
            "tags",
            "releasing only some of weights and kv_cache is not supported yet: send both, or \
             no tags",
        ));
    }
    Ok(())
}

/// A LoRA registry refusal (bad path, name taken, LoRA off), naming `param`; a pin past the
/// limit names `pinned`. An unknown adapter is the caller's 404, not a 400.
pub fn lora_refusal(e: LoraError, param: &str) -> RequestError {
    let param = match e {
        LoraError::PinLimit(_) => "pinned",
        _ => param,
    };
    RequestError::bad_param(param, e.to_string())
}

/// A generating request's SGLang `lora_path` (an adapter's name): LoRA on and the adapter
/// loaded (`found` is the registry's answer for `name`).
pub fn lora_path(
    lora_enabled: bool,
    name: &str,
    found: Option<Adapter>,
) -> Result<Adapter, RequestError> {
    if !lora_enabled {
        return Err(RequestError::bad_param(
            "lora_path",
            "LoRA adapters need the server started with --enable-lora",
        ));
    }
    found.ok_or_else(|| {
        RequestError::bad_param(
            "lora_path",
            format!("the LoRA adapter `{name}` is not loaded"),
        )
    })
}
