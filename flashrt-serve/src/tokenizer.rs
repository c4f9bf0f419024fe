//! Text <-> token ids through a Hugging Face `tokenizer.json`, when flashrt-serve is built
//! with the `tokenizers` feature. Without it, [`Tokenizer::load`] says so and the server
//! accepts token ids only (which it always does).

#[cfg(feature = "tokenizers")]
mod imp {
    use std::path::Path;

    /// A loaded `tokenizer.json`.
    pub struct Tokenizer(tokenizers::Tokenizer);

    impl Tokenizer {
        pub fn load(path: &Path) -> Result<Tokenizer, String> {
            tokenizers::Tokenizer::from_file(path)
                .map(Tokenizer)
                .map_err(|e| format!("{}: {e}", path.display()))
        }
        pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
            self.0
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| e.to_string())
        }
        pub fn decode(&self, ids: &[u32]) -> String {
            self.0.decode(ids, true).unwrap_or_default()
        }
        /// The id of a special token such as `<|im_end|>`.
        pub fn token_id(&self, token: &str) -> Option<u32> {
            self.0.token_to_id(token)
        }
    }
}

#[cfg(not(feature = "tokenizers"))]
mod imp {
    use std::path::Path;

    /// Stand-in: this build has no tokenizer support, so none is ever constructed.
    pub struct Tokenizer {
        never: std::convert::Infallible,
    }

    impl Tokenizer {
        pub fn load(path: &Path) -> Result<Tokenizer, String> {
            Err(format!(
                "{}: flashrt-serve was built without the `tokenizers` feature; send token ids, \
                 or rebuild with `--features flashrt-serve/tokenizers`",
                path.display()
            ))
        }
        pub fn encode(&self, _text: &str) -> Result<Vec<u32>, String> {
            match self.never {}
        }
        pub fn decode(&self, _ids: &[u32]) -> String {
            match self.never {}
        }
        pub fn token_id(&self, _token: &str) -> Option<u32> {
            match self.never {}
        }
    }
}

pub use imp::Tokenizer;

/// Whether this build can load tokenizers.
pub const AVAILABLE: bool = cfg!(feature = "tokenizers");

/// The new text of `ids` compared with `ids[..ids.len() - 1]` (streaming: pieces that merge
/// across tokens come out once they are complete).
pub fn decode_delta(tok: &Tokenizer, ids: &[u32], printed: &mut String) -> String {
    let text = tok.decode(ids);
    let delta = if text.starts_with(printed.as_str()) {
        text[printed.len()..].to_string()
    } else {
        String::new()
    };
    if text.starts_with(printed.as_str()) {
        *printed = text;
    }
    delta
}
