//! Renders a kustomize overlay with `kubectl kustomize` and splits the output into documents.

use std::path::Path;
use std::process::Command;

use serde::Deserialize;

use crate::DeployCheckError;

/// Runs `kubectl kustomize <dir>` and returns its YAML stream (documents separated by `---`).
/// `$KUBECTL` overrides the binary.
pub fn render(dir: &Path) -> Result<String, DeployCheckError> {
    let kubectl = std::env::var_os("KUBECTL").unwrap_or_else(|| "kubectl".into());
    let out = Command::new(kubectl)
        .arg("kustomize")
        .arg(dir)
        .output()
        .map_err(|source| DeployCheckError::KubectlMissing { dir: dir.to_path_buf(), source })?;
    if !out.status.success() {
        return Err(DeployCheckError::Kustomize {
            dir: dir.to_path_buf(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Splits a YAML stream into one JSON value per non-empty document.
pub fn split_documents(text: &str) -> Result<Vec<serde_json::Value>, DeployCheckError> {
    let mut docs = Vec::new();
    for (index, doc) in serde_norway::Deserializer::from_str(text).enumerate() {
        let value = serde_json::Value::deserialize(doc).map_err(|source| DeployCheckError::Yaml { index, source })?;
        if !value.is_null() {
            docs.push(value);
        }
    }
    Ok(docs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_documents_and_skips_empty_ones() {
        let docs = split_documents("a: 1\n---\n---\nb: [x]\n").unwrap();
        assert_eq!(docs.len(), 2);
        assert_eq!(docs[1]["b"][0], "x");
    }

    #[test]
    fn bad_yaml_names_the_document() {
        let err = split_documents("a: 1\n---\nb: [\n").unwrap_err();
        assert!(err.to_string().contains("document 1"), "{err}");
    }
}
