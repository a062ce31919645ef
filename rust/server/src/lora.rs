//! LoRA adapters the server can route requests to: name → (id, path), registered at start
//! (`--lora-paths`) or at run time (`/v1/load_lora_adapter`). A request names its adapter by
//! the OpenAI `model` field (vLLM) or `lora_path` (SGLang); it reaches the worker as the
//! adapter's id and path in the plan (`SamplingParams::lora_id`, `lora_path`), and the id keys
//! the prefix cache. Ids are never reused: an adapter unloaded and loaded again is a new id,
//! so the worker's cached weights and the cached KV of the old one are never taken for it.
//!
//! Loading here checks what the worker will need (the config, the rank, the modules, the
//! weights file) so a bad adapter is a 400 now, not a failed request later; the worker reads
//! the weights when the first request for the adapter arrives.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::RwLock;

use serde::{Deserialize, Serialize};
use tokenspeed_engine::{MAX_LORA_PATH, MAX_LORA_PINS};

/// The server's LoRA settings, as the launcher resolved them from the flags and the start-up
/// adapters (`python/tokenspeed/worker/lora.py` resolves the same for the workers).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraConfig {
    /// `--enable-lora` (or `--lora-paths`): adapters may be loaded and requested.
    pub enabled: bool,
    /// `--lora-paths`.
    pub adapters: Vec<StartAdapter>,
    /// `--max-lora-rank`: the worker's pool holds ranks up to this.
    pub max_rank: u32,
    /// HF module names the worker's pool adapts (`--lora-target-modules`, resolved).
    pub target_modules: Vec<String>,
    /// `--max-loras-per-batch`: distinct adapters in one step (the base model not counted).
    pub max_per_batch: u32,
}

impl LoraConfig {
    /// Distinct adapters the scheduler lets run at once (`Scheduler::limit_adapters`).
    pub fn max_per_batch_limit(&self) -> usize {
        if self.enabled {
            self.max_per_batch as usize
        } else {
            usize::MAX
        }
    }
}

/// An adapter of `--lora-paths`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartAdapter {
    pub name: String,
    pub path: String,
    /// SGLang's `pinned` (`--lora-paths '{..., "pinned": true}'`).
    #[serde(default)]
    pub pinned: bool,
}

/// A registered adapter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Adapter {
    pub id: u32,
    pub name: String,
    pub path: String,
    /// Never evicted from the workers' GPU pool, which keeps a slot for it (SGLang's
    /// `pinned`); unloading it frees the slot.
    pub pinned: bool,
}

/// Runs a request's sampling on `adapter` (None: the base model).
pub fn run_on(sampling: &mut tokenspeed_engine::SamplingParams, adapter: Option<Adapter>) {
    if let Some(a) = adapter {
        sampling.lora_id = a.id;
        sampling.lora_path = a.path.into_bytes();
    }
}

/// Why an adapter cannot be registered or found; the HTTP layer picks the status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoraError {
    Disabled,
    Unknown(String),
    Exists(String),
    Invalid(String),
    /// Pinning one more would leave no pool slot for the other adapters.
    PinLimit(usize),
}

impl std::fmt::Display for LoraError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LoraError::Disabled => write!(f, "LoRA adapters need --enable-lora"),
            LoraError::Unknown(n) => write!(f, "the LoRA adapter `{n}` is not loaded"),
            LoraError::Exists(n) => write!(f, "a LoRA adapter named `{n}` is already loaded"),
            LoraError::Invalid(why) => f.write_str(why),
            LoraError::PinLimit(n) => write!(
                f,
                "at most {n} adapters may be pinned: one of the --max-loras-per-batch pool \
                 slots stays for the adapters that are not"
            ),
        }
    }
}

/// Where the registry sends the pinned adapters' ids, all of them, each time they change
/// (the engines' schedulers, `Replicas::pin_adapters`).
pub type PinSink = Box<dyn Fn(Vec<u32>) + Send + Sync>;

pub struct LoraRegistry {
    config: LoraConfig,
    inner: RwLock<Inner>,
    pins_to: PinSink,
}

#[derive(Default)]
struct Inner {
    by_name: BTreeMap<String, Adapter>,
    last_id: u32,
}

impl LoraRegistry {
    /// The registry with the start-up adapters; an error names the first bad one. `pins_to`
    /// hears the pinned adapters now and after every change, in the order the changes
    /// happened (it is called under the registry's lock).
    pub fn new(config: LoraConfig, pins_to: PinSink) -> Result<Self, String> {
        let registry = LoraRegistry {
            inner: RwLock::new(Inner::default()),
            config,
            pins_to,
        };
        for a in registry.config.adapters.clone() {
            registry
                .load(&a.name, &a.path, a.pinned)
                .map_err(|e| format!("--lora-paths {}={}: {e}", a.name, a.path))?;
        }
        (registry.pins_to)(registry.pinned_ids(&registry.read()));
        Ok(registry)
    }

    /// Most adapters pinned at once: every pool slot but one (`LoraError::PinLimit`).
    fn max_pins(&self) -> usize {
        (self.config.max_per_batch as usize)
            .saturating_sub(1)
            .min(MAX_LORA_PINS)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Inner> {
        self.inner.read().unwrap_or_else(|e| e.into_inner())
    }

    fn pinned_ids(&self, inner: &Inner) -> Vec<u32> {
        inner
            .by_name
            .values()
            .filter(|a| a.pinned)
            .map(|a| a.id)
            .collect()
    }

    pub fn enabled(&self) -> bool {
        self.config.enabled
    }

    /// Registers `name` → `path` after checking the adapter fits the worker's pool.
    pub fn load(&self, name: &str, path: &str, pinned: bool) -> Result<Adapter, LoraError> {
        if !self.config.enabled {
            return Err(LoraError::Disabled);
        }
        if name.is_empty() || name.contains('=') {
            return Err(LoraError::Invalid(format!(
                "invalid LoRA adapter name {name:?} (non-empty, no '=')"
            )));
        }
        self.check_adapter(path)?;
        let mut inner = self.inner.write().unwrap_or_else(|e| e.into_inner());
        if inner.by_name.contains_key(name) {
            return Err(LoraError::Exists(name.to_string()));
        }
        if pinned && self.pinned_ids(&inner).len() >= self.max_pins() {
            return Err(LoraError::PinLimit(self.max_pins()));
        }
        inner.last_id += 1;
        let adapter = Adapter {
            id: inner.last_id,
            name: name.to_string(),
            path: path.to_string(),
            pinned,
        };
        inner.by_name.insert(name.to_string(), adapter.clone());
        if pinned {
            (self.pins_to)(self.pinned_ids(&inner));
        }
        Ok(adapter)
    }

    /// Removes `name`: new requests can no longer ask for it (running ones finish on it).
    pub fn unload(&self, name: &str) -> Result<Adapter, LoraError> {
        if !self.config.enabled {
            return Err(LoraError::Disabled);
        }
        let mut inner = self.inner.write().unwrap_or_else(|e| e.into_inner());
        let adapter = inner
            .by_name
            .remove(name)
            .ok_or_else(|| LoraError::Unknown(name.to_string()))?;
        if adapter.pinned {
            (self.pins_to)(self.pinned_ids(&inner));
        }
        Ok(adapter)
    }

    pub fn get(&self, name: &str) -> Option<Adapter> {
        self.read().by_name.get(name).cloned()
    }

    /// Every registered adapter, by name.
    pub fn list(&self) -> Vec<Adapter> {
        self.read().by_name.values().cloned().collect()
    }

    fn check_adapter(&self, path: &str) -> Result<(), LoraError> {
        let invalid = |why: String| LoraError::Invalid(format!("LoRA adapter {path}: {why}"));
        if path.len() > MAX_LORA_PATH {
            return Err(invalid(format!("the path is over {MAX_LORA_PATH} bytes")));
        }
        let dir = Path::new(path);
        let text = std::fs::read_to_string(dir.join("adapter_config.json"))
            .map_err(|e| invalid(format!("cannot read adapter_config.json: {e}")))?;
        let cfg: PeftConfig = serde_json::from_str(&text)
            .map_err(|e| invalid(format!("adapter_config.json: {e}")))?;
        if !dir.join("adapter_model.safetensors").is_file() {
            return Err(invalid("no adapter_model.safetensors".into()));
        }
        if cfg.r == 0 || cfg.r > self.config.max_rank {
            return Err(invalid(format!(
                "rank {} is not within 1..={} (--max-lora-rank)",
                cfg.r, self.config.max_rank
            )));
        }
        if cfg.use_dora {
            return Err(invalid("DoRA adapters are not supported".into()));
        }
        if let Some(serde_json::Value::Array(modules)) = &cfg.target_modules {
            let outside: Vec<&str> = modules
                .iter()
                .filter_map(|m| m.as_str())
                .filter(|m| !self.config.target_modules.iter().any(|t| t == m))
                .collect();
            if !outside.is_empty() {
                return Err(invalid(format!(
                    "targets {outside:?}, outside --lora-target-modules {:?}",
                    self.config.target_modules
                )));
            }
        }
        Ok(())
    }
}

/// The parts of PEFT's adapter_config.json checked at registration.
#[derive(Deserialize)]
struct PeftConfig {
    #[serde(default)]
    r: u32,
    #[serde(default)]
    target_modules: Option<serde_json::Value>,
    #[serde(default)]
    use_dora: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adapter_dir(tag: &str, r: u32, modules: &[&str]) -> String {
        let dir = std::env::temp_dir().join(format!("ts-lora-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let cfg = serde_json::json!({"r": r, "lora_alpha": 16, "target_modules": modules});
        std::fs::write(dir.join("adapter_config.json"), cfg.to_string()).expect("config");
        std::fs::write(dir.join("adapter_model.safetensors"), b"x").expect("weights");
        dir.to_string_lossy().into_owned()
    }

    type Heard = std::sync::Arc<std::sync::Mutex<Vec<Vec<u32>>>>;

    /// A registry with 4 pool slots, and what its pin sink heard.
    fn registry_hearing() -> (LoraRegistry, Heard) {
        let heard = Heard::default();
        let sink = heard.clone();
        let reg = LoraRegistry::new(
            LoraConfig {
                enabled: true,
                adapters: Vec::new(),
                max_rank: 16,
                target_modules: vec!["q_proj".into(), "v_proj".into()],
                max_per_batch: 4,
            },
            Box::new(move |pins| sink.lock().expect("sink").push(pins)),
        )
        .expect("registry");
        (reg, heard)
    }

    fn registry() -> LoraRegistry {
        registry_hearing().0
    }

    #[test]
    fn ids_are_never_reused() {
        let reg = registry();
        let path = adapter_dir("ids", 8, &["q_proj"]);
        let a = reg.load("a", &path, false).expect("load");
        assert_eq!(
            reg.load("a", &path, false),
            Err(LoraError::Exists("a".into()))
        );
        reg.unload("a").expect("unload");
        assert_eq!(reg.unload("a"), Err(LoraError::Unknown("a".into())));
        let again = reg.load("a", &path, false).expect("reload");
        assert!(again.id > a.id);
        assert_eq!(reg.list(), vec![again]);
    }

    #[test]
    fn adapters_the_pool_cannot_hold_are_refused() {
        let reg = registry();
        let big = adapter_dir("big", 32, &["q_proj"]);
        assert!(
            matches!(reg.load("big", &big, false), Err(LoraError::Invalid(m)) if m.contains("rank 32"))
        );
        let mlp = adapter_dir("mlp", 8, &["down_proj"]);
        assert!(
            matches!(reg.load("mlp", &mlp, false), Err(LoraError::Invalid(m)) if m.contains("down_proj"))
        );
        assert!(matches!(
            reg.load("none", "/no/such/dir", false),
            Err(LoraError::Invalid(_))
        ));
    }

    #[test]
    fn pins_leave_one_pool_slot_and_every_change_is_heard() {
        let (reg, heard) = registry_hearing();
        let path = adapter_dir("pins", 8, &["q_proj"]);
        let ids: Vec<u32> = ["p1", "p2", "p3"]
            .iter()
            .map(|n| reg.load(n, &path, true).expect("pin").id)
            .collect();
        assert_eq!(reg.load("p4", &path, true), Err(LoraError::PinLimit(3)));
        let plain = reg
            .load("plain", &path, false)
            .expect("an unpinned one still loads");
        assert!(!plain.pinned);
        reg.unload("p2").expect("unload");
        reg.unload("plain").expect("unload");
        let p4 = reg.load("p4", &path, true).expect("the freed pin slot");
        let heard = heard.lock().expect("heard").clone();
        assert_eq!(
            heard,
            vec![
                vec![],
                vec![ids[0]],
                ids[..2].to_vec(),
                ids.clone(),
                vec![ids[0], ids[2]],
                vec![ids[0], ids[2], p4.id],
            ],
            "the start, each pin and the pinned unload; not the unpinned ones"
        );
    }
}
