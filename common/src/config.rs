//! What the agent's and the picker's config errors share: [`InvalidField`], a value out of range
//! or inconsistent, named by its field, with its value and what to do (STYLE: a user-facing error
//! says what was wrong, where, and what to do); and, with the `yaml` feature, reading a YAML file
//! into a serde type ([`load_yaml`], [`read_bounded`] + [`parse_yaml`]) with one error type,
//! [`YamlFileError`], that names the file. The binaries' config files, the agent's mock GPU
//! scenarios and the pool and engine files `kvroute-cluster` watches are all read this way.

use std::fmt::Display;

/// One configuration field with a value that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} = {value}: {fix}")]
pub struct InvalidField {
    /// Which field, as written in the file, e.g. `models["m"].mode` or `engines["p"].endpoint`.
    pub field: String,
    /// Its value as given.
    pub value: String,
    /// What is wrong with it and what to do.
    pub fix: String,
}

impl InvalidField {
    /// `field` = `value`, with `fix`.
    pub fn new(field: impl Into<String>, value: impl Display, fix: impl Into<String>) -> Self {
        Self { field: field.into(), value: value.to_string(), fix: fix.into() }
    }
}

#[cfg(feature = "yaml")]
pub use yaml::{YamlFileError, load_yaml, parse_yaml, parse_yaml_str, read_bounded};

#[cfg(feature = "yaml")]
mod yaml {
    use std::path::{Path, PathBuf};

    use serde::de::DeserializeOwned;

    /// A YAML file that could not be read or does not fit its schema. `what` is what the file is
    /// to its reader ("config", "mock GPU scenario"; empty for a file named by its path alone):
    /// the message reads "cannot read config /etc/agent.yaml: …".
    #[derive(Debug, thiserror::Error)]
    #[non_exhaustive]
    pub enum YamlFileError {
        /// The file could not be read (or, for [`load_yaml`], is not UTF-8).
        #[error("cannot read {}: {source}", named(.what, .path))]
        Read {
            /// What the file is.
            what: &'static str,
            /// Path given.
            path: PathBuf,
            /// I/O error.
            source: std::io::Error,
        },
        /// The file is larger than the limit it was read with ([`read_bounded`]).
        #[error("{} is larger than {limit} bytes", named(.what, .path))]
        TooLarge {
            /// What the file is.
            what: &'static str,
            /// Path given.
            path: PathBuf,
            /// The limit, in bytes.
            limit: u64,
        },
        /// The YAML did not match the schema.
        #[error("invalid {}: {source}", named(.what, .path))]
        Parse {
            /// What the file is.
            what: &'static str,
            /// Path given (empty for text that came from no file).
            path: PathBuf,
            /// Parser error (names the field and position).
            source: serde_norway::Error,
        },
    }

    /// "`what` `path`", or the path alone when `what` is empty.
    fn named(what: &str, path: &Path) -> String {
        if what.is_empty() { path.display().to_string() } else { format!("{what} {}", path.display()) }
    }

    /// Reads the UTF-8 file `path` whole and parses it into `T`: a file an operator wrote for
    /// this process (a config file), read once at start.
    ///
    /// # Errors
    /// [`YamlFileError::Read`] (unreadable, not UTF-8) or [`YamlFileError::Parse`].
    pub fn load_yaml<T: DeserializeOwned>(what: &'static str, path: &Path) -> Result<T, YamlFileError> {
        let text = std::fs::read_to_string(path).map_err(|source| YamlFileError::Read {
            what,
            path: path.to_path_buf(),
            source,
        })?;
        parse_yaml_str(what, path, &text)
    }

    /// Reads `path` whole, at most `limit` bytes (checked on its size before the read and on what
    /// was read after, as the file may grow in between): a file re-read while it may change.
    ///
    /// # Errors
    /// [`YamlFileError::Read`] or [`YamlFileError::TooLarge`].
    pub fn read_bounded(what: &'static str, path: &Path, limit: u64) -> Result<Vec<u8>, YamlFileError> {
        let read = |source| YamlFileError::Read { what, path: path.to_path_buf(), source };
        let too_large = || YamlFileError::TooLarge { what, path: path.to_path_buf(), limit };
        if std::fs::metadata(path).map_err(read)?.len() > limit {
            return Err(too_large());
        }
        let bytes = std::fs::read(path).map_err(read)?;
        if bytes.len() as u64 > limit {
            return Err(too_large());
        }
        Ok(bytes)
    }

    /// Parses `bytes`, read from `path`, into `T`.
    ///
    /// # Errors
    /// [`YamlFileError::Parse`].
    pub fn parse_yaml<T: DeserializeOwned>(what: &'static str, path: &Path, bytes: &[u8]) -> Result<T, YamlFileError> {
        serde_norway::from_slice(bytes).map_err(|source| YamlFileError::Parse {
            what,
            path: path.to_path_buf(),
            source,
        })
    }

    /// Parses `text`, read from `path` (empty when it came from no file), into `T`.
    ///
    /// # Errors
    /// [`YamlFileError::Parse`].
    pub fn parse_yaml_str<T: DeserializeOwned>(
        what: &'static str,
        path: &Path,
        text: &str,
    ) -> Result<T, YamlFileError> {
        serde_norway::from_str(text).map_err(|source| YamlFileError::Parse { what, path: path.to_path_buf(), source })
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[derive(Debug, serde::Deserialize, PartialEq)]
        #[serde(deny_unknown_fields)]
        struct Doc {
            n: u32,
        }

        #[test]
        fn errors_name_the_file_and_the_step() {
            let dir = std::env::temp_dir().join(format!("kvroute-yaml-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let good = dir.join("good.yaml");
            std::fs::write(&good, "n: 3\n").unwrap();
            assert_eq!(load_yaml::<Doc>("config", &good).unwrap(), Doc { n: 3 });
            let bytes = read_bounded("", &good, 5).unwrap();
            assert_eq!(parse_yaml::<Doc>("", &good, &bytes).unwrap(), Doc { n: 3 });

            let big = read_bounded("", &good, 4).unwrap_err().to_string();
            assert_eq!(big, format!("{} is larger than 4 bytes", good.display()));
            let missing = dir.join("missing.yaml");
            let e = load_yaml::<Doc>("config", &missing).unwrap_err().to_string();
            assert!(e.starts_with(&format!("cannot read config {}: ", missing.display())), "{e}");
            let e = parse_yaml_str::<Doc>("config file", Path::new(""), "m: 1").unwrap_err().to_string();
            assert!(e.starts_with("invalid config file : unknown field `m`"), "{e}");
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }
}
