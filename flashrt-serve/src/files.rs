//! Files a client names (capsule export and import), opened as untrusted input: only regular
//! files, never through a symbolic link, never blocking the worker (a FIFO), and every
//! message names the file as the client did (relative to its files directory), never by its
//! absolute path on the server.

use crate::worker::ApiError;
use flashrt_runtime::Error;
use std::fs::File;
use std::path::Path;

/// Open `path` for reading if it is a regular file, not following a symbolic link in its last
/// component and without blocking (a FIFO opens at once and is refused).
pub fn open_regular(path: &Path, name: &str) -> Result<File, ApiError> {
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK);
    }
    let f = opts.open(path).map_err(|e| match e.raw_os_error() {
        #[cfg(unix)]
        Some(libc::ELOOP) => ApiError::bad(
            "invalid_file",
            format!("`{name}` is a symbolic link; only regular files are read"),
        ),
        _ if e.kind() == std::io::ErrorKind::NotFound => {
            ApiError::not_found("file_not_found", format!("no file `{name}`"))
        }
        _ => ApiError::bad(
            "invalid_file",
            format!("cannot open `{name}`: {}", e.kind()),
        ),
    })?;
    let meta = f
        .metadata()
        .map_err(|e| ApiError::bad("invalid_file", format!("`{name}`: {}", e.kind())))?;
    if !meta.is_file() {
        return Err(ApiError::bad(
            "invalid_file",
            format!(
                "`{name}` is {}; only regular files are read",
                if meta.is_dir() {
                    "a directory"
                } else {
                    "not a regular file"
                }
            ),
        ));
    }
    Ok(f)
}

/// Whether an export may write `path`: nothing there, or (with `overwrite`) a regular file.
pub fn check_export_target(path: &Path, name: &str, overwrite: bool) -> Result<(), ApiError> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(ApiError::bad(
            "invalid_file",
            format!("`{name}`: {}", e.kind()),
        )),
        Ok(m) if !m.is_file() => Err(ApiError::bad(
            "invalid_file",
            format!("`{name}` exists and is not a regular file"),
        )),
        Ok(_) if !overwrite => Err(ApiError::new(
            409,
            "file_exists",
            format!("`{name}` exists; send `\"overwrite\": true` to replace it"),
        )),
        Ok(_) => Ok(()),
    }
}

/// A runtime error about `path` in the client's words: `name` instead of the server path.
pub fn relative(e: Error, path: &Path, name: &str) -> ApiError {
    let full = path.display().to_string();
    let mut a = ApiError::from(e);
    a.message = a.message.replace(&full, name);
    if let Some(dir) = path.parent().map(|d| d.display().to_string())
        && !dir.is_empty()
    {
        a.message = a.message.replace(&dir, ".");
    }
    a
}
