// The macro form compiles, and its capsule exposes one field per state region.
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

flashrt::include_model!("../../../../models/lfm2-tiny.toml");

fn regions(capsule: &TinyACapsule) -> usize {
    capsule.layers_0_conv.bytes() + capsule.layers_1_key.bytes() + capsule.layers_1_value.bytes()
}

fn restore(session: &mut flashrt::TypedSession<TinyA>, capsule: &TinyACapsule) {
    session.restore(capsule).unwrap();
}

fn main() {
    use flashrt::Model;
    assert_eq!(TinyA::NAME, "tiny_a");
    assert_eq!(TinyA::STATE_REGIONS, ["layers.0.conv", "layers.1.key", "layers.1.value"]);
    assert_eq!(Lfm2Tiny::NAME, "lfm2_tiny");
    let _ = (regions, restore);
}
