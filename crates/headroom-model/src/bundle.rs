//! A [`ModelBundle`] is everything a worker needs to serve one model: config, tokenizer, chat
//! template and a content hash over all of them, so two workers can prove they hold the same
//! model. Weights stay on disk (memory-mapped) until a backend loads them.

use std::io::Read;
use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;
use sha2::{Digest, Sha256};
use tokenizers::Tokenizer;

use crate::config::LlamaConfig;
use crate::model::Llama;
use crate::template::ChatTemplate;
use crate::weights::{load_llama, WeightFiles};
use crate::{Error, Result};

/// The embedded demo model committed in the repository.
pub const DEFAULT_MODEL_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/default");

#[derive(Clone)]
pub struct ModelBundle {
    pub dir: PathBuf,
    pub config: LlamaConfig,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    /// Token ids that end generation.
    pub eos_ids: Vec<u32>,
    /// Text that a BOS token renders as, if the tokenizer has one.
    pub bos_token: Option<String>,
    /// sha256 over config, weights, tokenizer and template, hex.
    pub hash: String,
    /// Size of the weight files on disk.
    pub weight_file_bytes: u64,
}

impl std::fmt::Debug for ModelBundle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelBundle")
            .field("dir", &self.dir)
            .field("hash", &self.hash)
            .finish_non_exhaustive()
    }
}

/// `default` names the embedded model; anything else is a folder path.
pub fn resolve_model_dir(name: &str) -> PathBuf {
    if name == "default" {
        std::env::var_os("HEADROOM_DEFAULT_MODEL")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_MODEL_DIR))
    } else {
        PathBuf::from(name)
    }
}

fn folder_error(dir: &Path, reason: impl Into<String>) -> Error {
    Error::Folder {
        path: dir.display().to_string(),
        reason: reason.into(),
    }
}

fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path)?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| Error::Config(format!("{} is not valid JSON: {e}", path.display())))
}

impl ModelBundle {
    /// Opens a Hugging Face model folder. Weights are checked (headers parsed, hashed) but not
    /// loaded onto a device.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        if !dir.is_dir() {
            return Err(folder_error(
                &dir,
                "is not a folder; pass --model with a Hugging Face model folder or `default`",
            ));
        }
        let config_path = dir.join("config.json");
        let config_text = std::fs::read_to_string(&config_path)
            .map_err(|e| folder_error(&dir, format!("cannot read config.json: {e}")))?;
        let config = LlamaConfig::from_json(&config_text)?;

        let tokenizer_path = dir.join("tokenizer.json");
        if !tokenizer_path.exists() {
            return Err(folder_error(&dir, "has no tokenizer.json (the fast tokenizer file)"));
        }
        let tokenizer = Tokenizer::from_file(&tokenizer_path).map_err(|e| {
            Error::Tokenizer(format!("{} does not load: {e}", tokenizer_path.display()))
        })?;

        let tokenizer_config = read_json(&dir.join("tokenizer_config.json"))?;
        let template = match &tokenizer_config {
            Some(tc) => ChatTemplate::from_tokenizer_config(tc)?,
            None => None,
        };

        let mut eos_ids = config.eos_ids();
        if let Some(generation) = read_json(&dir.join("generation_config.json"))? {
            if let Ok(ids) =
                serde_json::from_value::<crate::config::TokenIds>(generation["eos_token_id"].clone())
            {
                eos_ids.extend(ids.to_vec());
            }
        }
        let special = |key: &str| -> Option<String> {
            let tc = tokenizer_config.as_ref()?;
            match &tc[key] {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
                _ => None,
            }
        };
        if let Some(eos) = special("eos_token") {
            if let Some(id) = tokenizer.token_to_id(&eos) {
                eos_ids.push(id);
            }
        }
        eos_ids.sort_unstable();
        eos_ids.dedup();

        // Parse every weight header now so a corrupt file fails at open, not mid-load.
        let weights = WeightFiles::open(&dir)?;
        drop(weights);

        let mut hasher = Sha256::new();
        let mut weight_file_bytes = 0;
        for name in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
            hash_file(&mut hasher, &dir.join(name))?;
        }
        for path in weight_paths(&dir)? {
            weight_file_bytes += std::fs::metadata(&path)?.len();
            hash_file(&mut hasher, &path)?;
        }
        let hash = hex::encode(hasher.finalize());

        Ok(Self {
            dir,
            config,
            tokenizer,
            template,
            eos_ids,
            bos_token: special("bos_token"),
            hash,
            weight_file_bytes,
        })
    }

    /// Loads the weights onto `device`. `on_layer(done, total)` reports progress.
    pub fn load<B: Backend>(
        &self,
        device: &B::Device,
        on_layer: impl FnMut(usize, usize),
    ) -> Result<Llama<B>> {
        let files = WeightFiles::open(&self.dir)?;
        load_llama(&files, &self.config, device, on_layer)
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.tokenizer
            .encode(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| Error::Tokenizer(format!("cannot encode the prompt: {e}")))
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| Error::Tokenizer(format!("cannot decode tokens: {e}")))
    }

    /// The prompt tokens of a conversation rendered through the chat template, with the
    /// assistant's turn opened. A template that writes the BOS token itself is not given a
    /// second one by the tokenizer.
    /// This bundle's prompt tokens for a client's prompt.
    pub fn tokenize(&self, input: &crate::generate::PromptInput) -> Result<Vec<u32>> {
        match input {
            crate::generate::PromptInput::Chat { messages, tools } => self.chat_prompt(messages, tools.as_ref()),
            crate::generate::PromptInput::Text { text } => self.encode(text, true),
        }
    }

    /// The request as this bundle runs it: prompt tokens made by another bundle's tokenizer are
    /// made again from the prompt they came from (a checkpoint of another bundle's tokens
    /// cannot be resumed here, so it is dropped: a replay).
    pub fn own_request(&self, request: &crate::GenerateRequest) -> Result<Option<crate::GenerateRequest>> {
        let Some(source) = request.source.as_ref().filter(|s| s.bundle_hash != self.hash) else {
            return Ok(None);
        };
        let mut own = request.clone();
        own.prompt_tokens = self.tokenize(&source.input)?;
        own.resume = None;
        own.source = Some(crate::generate::PromptSource { bundle_hash: self.hash.clone(), input: source.input.clone() });
        Ok(Some(own))
    }

    pub fn chat_prompt(&self, messages: &[crate::ChatMessage], tools: Option<&serde_json::Value>) -> Result<Vec<u32>> {
        let template = self.template.as_ref().ok_or_else(|| {
            Error::Template(format!("{} has no chat_template in tokenizer_config.json; use a plain completion instead", self.name()))
        })?;
        let text = template.render(messages, tools, true)?;
        let writes_bos = !template.bos_token.is_empty() && text.starts_with(&template.bos_token);
        self.encode(&text, !writes_bos)
    }

    /// The folder's name (`default` for the embedded model), for status lines and responses.
    pub fn name(&self) -> String {
        self.dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| self.dir.display().to_string())
    }

    /// A short id for logs and status: the first 12 hex digits of the hash.
    pub fn short_hash(&self) -> &str {
        &self.hash[..12]
    }
}

fn weight_paths(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    paths.sort();
    Ok(paths)
}

fn hash_file(hasher: &mut Sha256, path: &Path) -> Result<()> {
    let Ok(mut file) = std::fs::File::open(path) else {
        hasher.update(b"absent");
        return Ok(());
    };
    hasher.update(path.file_name().unwrap_or_default().as_encoded_bytes());
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(())
}
