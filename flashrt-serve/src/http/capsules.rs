//! The capsules API: list, inspect, delete, persist, export (to a file or as bytes), import.

use super::*;

pub(super) async fn list_capsules(State(st): St) -> Response {
    call_json(&st, Cmd::ListCapsules).await
}

pub(super) async fn capsule_info(State(st): St, Path(id): Path<String>) -> Response {
    if let Err(e) = check_id(&id, "unknown_capsule") {
        return e.into_response();
    }
    call_json(&st, Cmd::CapsuleInfo(id)).await
}

pub(super) async fn delete_capsule(State(st): St, Path(id): Path<String>) -> Response {
    if let Err(e) = check_id(&id, "unknown_capsule") {
        return e.into_response();
    }
    call_json(&st, Cmd::DeleteCapsule(id)).await
}

pub(super) async fn persist(State(st): St, Path(id): Path<String>) -> Response {
    if let Err(e) = check_id(&id, "unknown_capsule") {
        return e.into_response();
    }
    call_json(&st, Cmd::PersistCapsule(id)).await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileBody {
    file: String,
    /// Export only: replace an existing file.
    #[serde(default)]
    overwrite: bool,
}

/// `file` as a plain name inside the tenant's files directory (`FILES_DIR` for the default
/// tenant, `FILES_DIR/<tenant>` for a named one; created on first use).
fn file_path(st: &AppState, name: &str) -> Result<PathBuf, ApiError> {
    let tenant = current_tenant()?;
    let Some(root) = &st.files_dir else {
        return Err(ApiError::bad(
            "no_files_dir",
            "this server has no files directory (start it with --store-dir or --files-dir); \
             use GET /v1/capsules/{id}/file and an octet-stream import instead",
        ));
    };
    let ok = !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
    if !ok {
        return Err(ApiError::bad(
            "invalid_file_name",
            format!(
                "`{}` is not a plain file name (letters, digits, `.`, `_`, `-`; at most 128)",
                name.escape_debug()
            ),
        ));
    }
    let dir = if tenant.name.is_empty() {
        root.clone()
    } else {
        root.join(&*tenant.name)
    };
    std::fs::create_dir_all(&dir).map_err(|e| {
        ApiError::new(
            500,
            "files_dir",
            format!("the files directory cannot be created: {}", e.kind()),
        )
    })?;
    Ok(dir.join(name))
}

pub(super) async fn export(State(st): St, Path(id): Path<String>, body: Body) -> Response {
    let r = async {
        check_id(&id, "unknown_capsule")?;
        let b: FileBody = parse(&st, body).await?;
        Ok::<_, ApiError>(Cmd::ExportFile {
            capsule: id,
            path: file_path(&st, &b.file)?,
            name: b.file,
            overwrite: b.overwrite,
        })
    }
    .await;
    match r {
        Ok(cmd) => call_json(&st, cmd).await,
        Err(e) => e.into_response(),
    }
}

pub(super) async fn export_bytes(State(st): St, Path(id): Path<String>) -> Response {
    if let Err(e) = check_id(&id, "unknown_capsule") {
        return e.into_response();
    }
    call_json(&st, Cmd::ExportBytes(id)).await
}

pub(super) async fn import(State(st): St, headers: HeaderMap, body: Body) -> Response {
    let binary = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/octet-stream"));
    let r = async {
        if binary {
            let bytes = read_body(&st, body).await?;
            return Ok(Cmd::ImportBytes(bytes.to_vec()));
        }
        let b: FileBody = parse(&st, body).await?;
        if b.overwrite {
            return Err(ApiError::bad(
                "invalid_request",
                "`overwrite` is for exports",
            ));
        }
        Ok::<_, ApiError>(Cmd::ImportFile {
            path: file_path(&st, &b.file)?,
            name: b.file,
        })
    }
    .await;
    match r {
        Ok(cmd) => call_json(&st, cmd).await,
        Err(e) => e.into_response(),
    }
}
