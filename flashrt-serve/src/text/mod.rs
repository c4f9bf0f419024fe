//! Text in and out: a checkpoint's tokenizer and chat template, streamed detokenisation, stop
//! strings, and the generation defaults it ships.
//!
//! * [`Tokenizer`]: `tokenizer.json` through the `tokenizers` crate.
//! * [`ChatTemplate`]: the model's own Jinja template, rendered as transformers renders it.
//! * [`TextStream`]: ids to text as they are generated, whole characters only, stop strings
//!   held back (streamed text equals the non-streamed text).
//! * [`Text`] bundles what a checkpoint folder holds ([`Text::from_dir`]), and
//!   [`GenerationDefaults`] reads `generation_config.json` (sampling defaults, every EOS id).

mod prefix;
mod stream;
mod template;
mod tokenizer;

pub use prefix::PrefixTokens;
pub use stream::{Piece, TextStream, cut_at_stop};
pub use template::{ChatTemplate, RenderOptions, strftime};
pub use tokenizer::Tokenizer;

use serde_json::Value;
use std::path::{Path, PathBuf};

/// A tokenizer and, where the checkpoint has one, its chat template.
pub struct Text {
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    /// Where the tokenizer was read from.
    pub origin: PathBuf,
    /// `eos_token` of `tokenizer_config.json` (the end of an assistant turn for many chat
    /// models), when there is one.
    pub eos_token: Option<String>,
    /// The last prompts' ids, so a conversation sent again with a new turn is tokenized from
    /// its last shared added token on ([`PrefixTokens`]).
    pub prefixes: PrefixTokens,
}

impl std::fmt::Debug for Text {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Text")
            .field("origin", &self.origin)
            .field("template", &self.template)
            .finish()
    }
}

impl Text {
    /// `tokenizer.json` and the chat template of a checkpoint folder; `Ok(None)` when the
    /// folder has no `tokenizer.json`. A tokenizer or template that is present but cannot be
    /// loaded is an error.
    pub fn from_dir(dir: &Path) -> Result<Option<Text>, String> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Ok(None);
        }
        Text::load(&path, Some(dir)).map(Some)
    }

    /// A tokenizer file, and the chat template of `template_dir` (the tokenizer's folder when
    /// `None`).
    pub fn load(tokenizer: &Path, template_dir: Option<&Path>) -> Result<Text, String> {
        let tok = Tokenizer::load(tokenizer)?;
        let dir = template_dir
            .map(Path::to_path_buf)
            .or_else(|| tokenizer.parent().map(Path::to_path_buf))
            .unwrap_or_default();
        let template = ChatTemplate::from_dir(&dir)?;
        let eos_token = std::fs::read_to_string(dir.join("tokenizer_config.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            .and_then(|c| match &c["eos_token"] {
                Value::String(s) => Some(s.clone()),
                Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
                _ => None,
            });
        Ok(Text {
            prefixes: PrefixTokens::new(&tok),
            tokenizer: tok,
            template,
            origin: tokenizer.to_path_buf(),
            eos_token,
        })
    }

    /// The id of `eos_token`, if the tokenizer knows it.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.tokenizer.token_id(self.eos_token.as_deref()?)
    }
}

/// What a checkpoint's `generation_config.json` (and `config.json`) say about generating:
/// sampling defaults and every end-of-sequence id.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationDefaults {
    /// Stop ids: `eos_token_id` of generation_config.json, config.json and its
    /// `text_config` (an id or a list of ids), in that order, without duplicates.
    pub eos: Vec<u32>,
    /// `do_sample: false` forces greedy decoding.
    pub do_sample: Option<bool>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub max_new_tokens: Option<usize>,
}

fn ids_of(v: &Value) -> Vec<u32> {
    match v {
        Value::Number(n) => n
            .as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .into_iter()
            .collect(),
        Value::Array(a) => a.iter().flat_map(ids_of).collect(),
        _ => Vec::new(),
    }
}

impl GenerationDefaults {
    /// Read `dir/generation_config.json` and `dir/config.json` (missing files are fine; a
    /// file that is not JSON is an error).
    pub fn from_dir(dir: &Path) -> Result<GenerationDefaults, String> {
        let read = |name: &str| -> Result<Option<Value>, String> {
            let p = dir.join(name);
            match std::fs::read_to_string(&p) {
                Ok(t) => serde_json::from_str(&t)
                    .map(Some)
                    .map_err(|e| format!("{}: not valid JSON: {e}", p.display())),
                Err(_) => Ok(None),
            }
        };
        let gen_cfg = read("generation_config.json")?.unwrap_or(Value::Null);
        let config = read("config.json")?.unwrap_or(Value::Null);
        let mut eos = Vec::new();
        for v in [
            &gen_cfg["eos_token_id"],
            &config["eos_token_id"],
            &config["text_config"]["eos_token_id"],
        ] {
            for id in ids_of(v) {
                if !eos.contains(&id) {
                    eos.push(id);
                }
            }
        }
        let f = |k: &str| gen_cfg[k].as_f64().map(|x| x as f32);
        Ok(GenerationDefaults {
            eos,
            do_sample: gen_cfg["do_sample"].as_bool(),
            temperature: f("temperature"),
            top_p: f("top_p"),
            top_k: gen_cfg["top_k"].as_u64().map(|x| x as u32),
            max_new_tokens: gen_cfg["max_new_tokens"].as_u64().map(|x| x as usize),
        })
    }

    /// The sampler a request that says nothing gets: greedy when the checkpoint says
    /// `do_sample: false` or gives no temperature, else its temperature, top-p and top-k.
    pub fn sampler(&self, seed: u64) -> flashrt_runtime::SamplerState {
        let sample = self.do_sample.unwrap_or(self.temperature.is_some());
        if sample {
            flashrt_runtime::SamplerState::seeded(
                seed,
                self.temperature.unwrap_or(1.0),
                self.top_k.unwrap_or(0) as usize,
                self.top_p.unwrap_or(1.0),
            )
        } else {
            flashrt_runtime::SamplerState::seeded(seed, 0.0, 0, 1.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_config_defaults_and_every_eos() {
        let dir = std::env::temp_dir().join(format!("flashrt-gencfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("generation_config.json"),
            r#"{"eos_token_id": [7, 9], "do_sample": true, "temperature": 0.6, "top_p": 0.95, "top_k": 20}"#,
        )
        .unwrap();
        std::fs::write(
            dir.join("config.json"),
            r#"{"eos_token_id": 9, "text_config": {"eos_token_id": 11}}"#,
        )
        .unwrap();
        let g = GenerationDefaults::from_dir(&dir).unwrap();
        assert_eq!(g.eos, [7, 9, 11]);
        assert_eq!(
            (g.temperature, g.top_p, g.top_k),
            (Some(0.6), Some(0.95), Some(20))
        );
        let s = g.sampler(3);
        assert_eq!((s.temperature, s.top_p, s.top_k), (0.6, 0.95, 20));
        std::fs::write(
            dir.join("generation_config.json"),
            r#"{"do_sample": false, "temperature": 0.6}"#,
        )
        .unwrap();
        let g = GenerationDefaults::from_dir(&dir).unwrap();
        assert!(g.sampler(3).is_greedy());
        std::fs::write(dir.join("config.json"), "{not json").unwrap();
        assert!(GenerationDefaults::from_dir(&dir).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
