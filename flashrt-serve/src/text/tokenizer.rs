//! Text <-> token ids through a Hugging Face `tokenizer.json` (the `tokenizers` crate).

use std::path::Path;
use std::sync::Arc;

/// A loaded `tokenizer.json`; cloning shares it.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
}

impl Tokenizer {
    /// Load a `tokenizer.json`; the error names the file.
    pub fn load(path: &Path) -> Result<Tokenizer, String> {
        if !path.is_file() {
            return Err(format!("{}: no such tokenizer file", path.display()));
        }
        tokenizers::Tokenizer::from_file(path)
            .map(|inner| Tokenizer {
                inner: Arc::new(inner),
            })
            .map_err(|e| format!("{}: not a loadable tokenizer.json: {e}", path.display()))
    }

    /// A tokenizer from the bytes of a `tokenizer.json`.
    pub fn from_bytes(bytes: &[u8]) -> Result<Tokenizer, String> {
        tokenizers::Tokenizer::from_bytes(bytes)
            .map(|inner| Tokenizer {
                inner: Arc::new(inner),
            })
            .map_err(|e| format!("not a loadable tokenizer.json: {e}"))
    }

    /// Ids of `text`, special tokens in it recognised, nothing added around it (what a
    /// rendered chat template and the Qwen reference tokenizer want).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.encode_with(text, false)
    }

    /// Ids of `text`; `add_special` adds what the tokenizer's post-processor adds (a BOS
    /// token, say), as transformers' `tokenizer(text)` does.
    pub fn encode_with(&self, text: &str, add_special: bool) -> Result<Vec<u32>, String> {
        self.inner
            .encode(text, add_special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| e.to_string())
    }

    /// The text of `ids` with special tokens left out (what a client reads).
    pub fn decode(&self, ids: &[u32]) -> String {
        self.decode_with(ids, true)
    }

    /// The text of `ids`; `skip_special` leaves special tokens out. Ids outside the
    /// vocabulary decode to nothing.
    pub fn decode_with(&self, ids: &[u32], skip_special: bool) -> String {
        self.inner.decode(ids, skip_special).unwrap_or_default()
    }

    /// The id of a token such as `<|im_end|>`.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of an id.
    pub fn token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The `tokenizers` tokenizer (offsets, added tokens).
    pub(super) fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Tokens in the vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}
