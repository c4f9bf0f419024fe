// An unknown router score function.
#[flashrt::model(
    model = {
        name = "tiny_moe", vocab = 64, hidden = 32, dtype = "f32", max_seq = 128, prefill_buckets = [8],
        norm = { kind = "rms", eps = 1e-5, weight = "plain" }, weights = "qwen3_5_text",
    },
    kinds = {
        moe = {
            mlp = { kind = "moe", experts = 4, top_k = 2, intermediate = 16, router = "top2" },
        },
    },
    stack = { pattern = [moe] },
)]
pub struct TinyMoe;

fn main() {}
