//! Streaming text out of generated ids: incremental detokenisation that never splits a
//! character, and stop strings that never reach the client.
//!
//! **Detokenisation.** Byte-level BPE tokens are bytes, not characters: a CJK character or
//! an emoji often spans two or three tokens, and decoding a prefix that ends inside one yields
//! U+FFFD. [`TextStream`] decodes a short window of recent ids twice — with and without the
//! newest ones — and releases the difference only when the window does not end in U+FFFD
//! (the scheme of vLLM's and text-generation-inference's detokenisers): each token costs two
//! decodes of a few ids, and a character arrives whole, once. Decoding a window rather than a
//! single id keeps what decoders do at token boundaries (a SentencePiece `▁` becomes a space
//! only after a word) identical to a whole-sequence decode.
//!
//! **Stop strings.** Text that could be the beginning of a stop string is held back until
//! it either completes one (then the text before it is released and generation stops) or
//! can no longer do so. What a client streams is therefore exactly the non-streamed text:
//! the decoded completion cut before the first stop string.

use super::Tokenizer;

/// What one generated id produced.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Piece {
    /// Text a client may show now (possibly empty).
    pub text: String,
    /// A stop string is complete: stop generating; `text` is everything before it.
    pub stop: bool,
}

/// Incremental detokeniser with stop strings (see the module docs).
pub struct TextStream {
    tok: Tokenizer,
    ids: Vec<u32>,
    /// Ids `prefix..read` are the window decoded last time; `read..` are new.
    prefix: usize,
    read: usize,
    /// Text released by the detokeniser so far.
    decoded: String,
    stops: Vec<String>,
    /// Decoded text not yet released: it might be the start of a stop string.
    held: String,
    /// Text released to the client so far.
    shown: String,
    stopped: bool,
}

impl TextStream {
    /// A stream over `tok` (a cheap handle: the vocabulary is shared).
    pub fn new(tok: &Tokenizer, stops: &[String]) -> TextStream {
        TextStream {
            tok: tok.clone(),
            ids: Vec::new(),
            prefix: 0,
            read: 0,
            decoded: String::new(),
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
            shown: String::new(),
            stopped: false,
        }
    }

    /// The next generated id.
    pub fn push(&mut self, id: u32) -> Piece {
        if self.stopped {
            return Piece {
                text: String::new(),
                stop: true,
            };
        }
        self.ids.push(id);
        let before = self.tok.decode(&self.ids[self.prefix..self.read]);
        let now = self.tok.decode(&self.ids[self.prefix..]);
        let delta =
            if now.len() > before.len() && now.starts_with(&before) && !now.ends_with('\u{FFFD}') {
                self.prefix = self.read;
                self.read = self.ids.len();
                now[before.len()..].to_string()
            } else {
                String::new()
            };
        self.decoded.push_str(&delta);
        self.release(delta, false)
    }

    /// No more ids: everything still held back (an incomplete character's replacement, text
    /// that only looked like the start of a stop string).
    pub fn finish(&mut self) -> Piece {
        if self.stopped {
            return Piece {
                text: String::new(),
                stop: true,
            };
        }
        let full = self.tok.decode(&self.ids);
        let tail = match full.strip_prefix(self.decoded.as_str()) {
            Some(t) => t.to_string(),
            None => String::new(),
        };
        self.decoded.push_str(&tail);
        self.release(tail, true)
    }

    /// Every text released so far.
    pub fn text(&self) -> &str {
        &self.shown
    }

    pub fn stopped(&self) -> bool {
        self.stopped
    }

    fn release(&mut self, delta: String, last: bool) -> Piece {
        self.held.push_str(&delta);
        let found = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        let out = if let Some(i) = found {
            self.stopped = true;
            let out = self.held[..i].to_string();
            self.held.clear();
            out
        } else {
            // Keep the longest tail that a stop string starts with.
            let keep = if last {
                0
            } else {
                self.stops
                    .iter()
                    .map(|s| longest_prefix_suffix(&self.held, s))
                    .max()
                    .unwrap_or(0)
            };
            let cut = self.held.len() - keep;
            let out = self.held[..cut].to_string();
            self.held.drain(..cut);
            out
        };
        self.shown.push_str(&out);
        Piece {
            text: out,
            stop: self.stopped,
        }
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop` (at a character
/// boundary of both).
fn longest_prefix_suffix(text: &str, stop: &str) -> usize {
    let max = text.len().min(stop.len().saturating_sub(1));
    (1..=max)
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n)
                && stop.is_char_boundary(n)
                && text.ends_with(&stop[..n])
        })
        .unwrap_or(0)
}

/// `text` cut before the first occurrence of any stop string (what a non-streamed answer
/// returns; [`TextStream`] streams the same text).
pub fn cut_at_stop(text: &str, stops: &[String]) -> String {
    match stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text.find(s.as_str()))
        .min()
    {
        Some(i) => text[..i].to_string(),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suffix_prefix_overlap() {
        assert_eq!(longest_prefix_suffix("hello wor", "world"), 3);
        assert_eq!(longest_prefix_suffix("hello", "world"), 0);
        assert_eq!(longest_prefix_suffix("ab", "abc"), 2);
        // Only proper prefixes are held: a whole stop string is a match.
        assert_eq!(longest_prefix_suffix("abc", "abc"), 0);
        assert_eq!(longest_prefix_suffix("xab", "abc"), 2);
        assert_eq!(longest_prefix_suffix("x√", "√y"), "√".len());
        assert_eq!(cut_at_stop("one two three", &["two".into()]), "one ");
        assert_eq!(cut_at_stop("one", &["".into()]), "one");
    }
}
