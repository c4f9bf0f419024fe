// A capsule of model TinyA cannot be restored into a session of model TinyB.
#[flashrt::model(
    model = {
        name = "tiny_a", vocab = 64, hidden = 32, dtype = "f32", max_seq = 128, prefill_buckets = [8],
        norm = { kind = "rms", eps = 1e-5, weight = "plain" }, tie_embeddings = true, weights = "lfm2",
    },
    kinds = {
        conv = { mixer = { kind = "short_conv", conv = 3 }, mlp = { kind = "swiglu", intermediate = 64 } },
        attn = {
            mixer = { kind = "attention", q_heads = 4, kv_heads = 2, head_dim = 8, qk_norm = true, rope = { theta = 10000.0 } },
            mlp = { kind = "swiglu", intermediate = 64 },
        },
    },
    stack = { pattern = [conv, attn] },
)]
pub struct TinyA;

#[flashrt::model(
    model = {
        name = "tiny_b", vocab = 64, hidden = 32, dtype = "f32", max_seq = 128, prefill_buckets = [8],
        norm = { kind = "rms", eps = 1e-5, weight = "plain" }, tie_embeddings = true, weights = "lfm2",
    },
    kinds = {
        conv = { mixer = { kind = "short_conv", conv = 3 }, mlp = { kind = "swiglu", intermediate = 64 } },
        attn = {
            mixer = { kind = "attention", q_heads = 4, kv_heads = 2, head_dim = 8, qk_norm = true, rope = { theta = 10000.0 } },
            mlp = { kind = "swiglu", intermediate = 64 },
        },
    },
    stack = { pattern = [attn, conv] },
)]
pub struct TinyB;

fn restore_into_b(session: &mut flashrt::TypedSession<TinyB>, capsule: &TinyACapsule) {
    session.restore(capsule).unwrap();
}

fn main() {}
