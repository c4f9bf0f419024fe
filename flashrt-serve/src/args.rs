//! The `flashrt` command line's flag parser, shared by every subcommand. It lives in this
//! crate because the `serve` subcommand is implemented here, below the CLI crate that
//! dispatches the others.
//!
//! A command declares its switches (`--name`) and valued flags (`--name VALUE`); anything
//! else starting with `--` is an error, every other argument is positional. When a flag is
//! given twice, the last one wins.

use std::str::FromStr;

/// A parsed command line.
#[derive(Debug)]
pub struct Args {
    pub positional: Vec<String>,
    flags: Vec<(String, Option<String>)>,
}

impl Args {
    pub fn parse(args: &[String], switches: &[&str], valued: &[&str]) -> Result<Args, String> {
        let mut out = Args {
            positional: vec![],
            flags: vec![],
        };
        let mut it = args.iter();
        while let Some(a) = it.next() {
            if let Some(name) = a.strip_prefix("--") {
                if switches.contains(&name) {
                    out.flags.push((name.to_string(), None));
                } else if valued.contains(&name) {
                    let v = it.next().ok_or_else(|| format!("--{name} needs a value"))?;
                    out.flags.push((name.to_string(), Some(v.clone())));
                } else {
                    return Err(format!("unknown option `{a}`"));
                }
            } else {
                out.positional.push(a.clone());
            }
        }
        Ok(out)
    }

    /// The value of `--name` (the last one given).
    pub fn get(&self, name: &str) -> Option<&str> {
        self.flags
            .iter()
            .rev()
            .find(|(n, _)| n == name)
            .and_then(|(_, v)| v.as_deref())
    }

    /// Whether the switch `--name` was given.
    pub fn has(&self, name: &str) -> bool {
        self.flags.iter().any(|(n, _)| n == name)
    }

    /// `--name N` parsed as a number.
    pub fn num<T: FromStr>(&self, name: &str) -> Result<Option<T>, String> {
        self.get(name)
            .map(|v| {
                v.parse()
                    .map_err(|_| format!("--{name}: `{v}` is not a number"))
            })
            .transpose()
    }

    /// `--name 1,2,3` parsed as a list of numbers.
    pub fn list<T: FromStr>(&self, name: &str) -> Result<Option<Vec<T>>, String> {
        self.get(name)
            .map(|v| {
                v.split(',')
                    .map(|x| {
                        x.trim()
                            .parse()
                            .map_err(|_| format!("--{name}: `{x}` is not a number"))
                    })
                    .collect()
            })
            .transpose()
    }

    /// Exactly one positional argument, described as `what` in errors.
    pub fn one(&self, what: &str) -> Result<&str, String> {
        match self.positional.as_slice() {
            [p] => Ok(p),
            [] => Err(format!("missing {what}")),
            more => Err(format!("expected one {what}, got {}", more.len())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn switches_values_positionals_and_errors() {
        let a = Args::parse(
            &argv("m.toml --ops --target bf16 --target f32 --lens 1,2"),
            &["ops"],
            &["target", "lens"],
        )
        .unwrap();
        assert_eq!(a.one("model").unwrap(), "m.toml");
        assert!(a.has("ops"));
        assert_eq!(a.get("target"), Some("f32"), "last wins");
        assert_eq!(a.list::<usize>("lens").unwrap(), Some(vec![1, 2]));
        assert_eq!(a.num::<u32>("missing").unwrap(), None);
        assert!(
            Args::parse(&argv("--bogus"), &[], &[])
                .unwrap_err()
                .contains("--bogus")
        );
        assert!(
            Args::parse(&argv("--target"), &[], &["target"])
                .unwrap_err()
                .contains("needs a value")
        );
        let b = Args::parse(&argv("--n x --l 1,y"), &[], &["n", "l"]).unwrap();
        assert!(b.num::<u32>("n").unwrap_err().contains("`x`"));
        assert!(b.list::<u32>("l").unwrap_err().contains("`y`"));
        assert!(
            Args::parse(&argv("a b"), &[], &[])
                .unwrap()
                .one("file")
                .is_err()
        );
    }
}
