//! External tensor data, read only from inside the model's own folder.

use super::proto::TensorProto;
use crate::error::{Error, Result};
use crate::ir::DType;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Component, Path, PathBuf};

/// Resolves external data files relative to the model's folder.
pub struct ExternalData {
    dir: PathBuf,
}

impl ExternalData {
    /// `dir` is the folder holding the model file.
    pub fn new(dir: &Path) -> Result<ExternalData> {
        let dir = dir.canonicalize().map_err(|e| Error::Io {
            path: dir.to_path_buf(),
            source: e,
        })?;
        Ok(ExternalData { dir })
    }

    /// Reads the bytes of one externally stored tensor, after checking that its
    /// location stays inside the model folder and its range lies inside the file.
    pub fn read(&self, t: &TensorProto, dt: DType, n: usize, what: &str) -> Result<Vec<u8>> {
        let mut location = None;
        let mut offset = 0u64;
        let mut length = None;
        for kv in &t.external_data {
            let v = kv.value.clone().unwrap_or_default();
            let num = |v: &str| {
                v.parse::<u64>().map_err(|_| {
                    Error::model(format!(
                        "{what}: external data {} `{v}` is not a number",
                        kv.key()
                    ))
                })
            };
            match kv.key() {
                "location" => location = Some(v),
                "offset" => offset = num(&v)?,
                "length" => length = Some(num(&v)?),
                _ => {}
            }
        }
        let location = location
            .ok_or_else(|| Error::model(format!("{what}: external data has no `location`")))?;
        let rel = Path::new(&location);
        let hostile = || {
            Error::model(format!(
                "{what}: external data location `{location}` points outside the model's folder; onnxc only reads files next to the model"
            ))
        };
        if rel.is_absolute()
            || rel
                .components()
                .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
        {
            return Err(hostile());
        }
        let path = self.dir.join(rel);
        let real = path.canonicalize().map_err(|e| Error::Io {
            path: path.clone(),
            source: e,
        })?;
        if !real.starts_with(&self.dir) {
            return Err(hostile());
        }
        let mut f = std::fs::File::open(&real).map_err(|e| Error::Io {
            path: real.clone(),
            source: e,
        })?;
        let size = f
            .metadata()
            .map_err(|e| Error::Io {
                path: real.clone(),
                source: e,
            })?
            .len();
        let need = ((n as u128 * dt.bits() as u128).div_ceil(8)) as u64;
        let len = length.unwrap_or(need);
        if len != need {
            return Err(Error::model(format!(
                "{what}: external data length {len} does not match the {need} bytes its shape needs"
            )));
        }
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::model(format!(
                "{what}: external data range {offset}..{} lies beyond the end of `{location}` ({size} bytes)",
                offset.saturating_add(len)
            )));
        }
        f.seek(SeekFrom::Start(offset)).map_err(|e| Error::Io {
            path: real.clone(),
            source: e,
        })?;
        let mut buf = vec![0u8; len as usize];
        f.read_exact(&mut buf).map_err(|e| Error::Io {
            path: real,
            source: e,
        })?;
        Ok(buf)
    }
}
