// 6 query heads cannot be shared evenly by 4 KV heads.
#[flashrt::model(
    model = {
        name = "tiny_a", vocab = 64, hidden = 32, dtype = "f32", max_seq = 128, prefill_buckets = [8],
        norm = { kind = "rms", eps = 1e-5, weight = "plain" }, tie_embeddings = true, weights = "lfm2",
    },
    kinds = {
        attn = {
            mixer = { kind = "attention", q_heads = 6, kv_heads = 4, head_dim = 8, rope = { theta = 10000.0 } },
            mlp = { kind = "swiglu", intermediate = 64 },
        },
    },
    stack = { pattern = [attn] },
)]
pub struct TinyA;

fn main() {}
