// The kind name `conv` is declared twice.
#[flashrt::model(
    model = {
        name = "tiny_a", vocab = 64, hidden = 32, dtype = "f32", max_seq = 128, prefill_buckets = [8],
        norm = { kind = "rms", eps = 1e-5, weight = "plain" }, tie_embeddings = true, weights = "lfm2",
    },
    kinds = {
        conv = { mixer = { kind = "short_conv", conv = 3 } },
        conv = { mixer = { kind = "short_conv", conv = 4 } },
    },
    stack = { pattern = [conv] },
)]
pub struct TinyA;

fn main() {}
