//! The machinery behind the declared plan/result schema (`plan.rs`): sections of rows, each
//! encoded column by column into one flat little-endian payload.
//!
//! A section is declared once with `section!`: the macro writes the Rust row struct and its
//! column codec. A message (`Plan`, `StepResult`) is declared once with `message!` as a list of
//! sections. Everything else follows from those declarations: the byte layout (every array
//! 8-byte aligned, offsets computed from the counts in the header), encode and decode, the
//! bound on a message's size (the shm slot size), and the array names and dtypes the Python
//! worker reads through `tokenspeed._core`. Adding a field is one line in its section.
//!
//! Payload: `magic u32 | n_counts u32 | step_id u64 | counts u32[n_counts]`, then the arrays.
//! Counts, per section in order: its row count, then the total length of each list field.
//! Arrays, per section in order, per field in order: a scalar field is one array of `rows`
//! elements named `{section}_{field}`; a list field is `{section}_{field}_len` (u32, one per
//! row) followed by `{section}_{field}` (all rows' elements, concatenated).

use std::fmt::Debug;

use thiserror::Error;

/// Element type of one array (numpy spelling via [`DType::numpy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    U8,
    U32,
    I32,
    F32,
    I64,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::U8 => 1,
            DType::U32 | DType::I32 | DType::F32 => 4,
            DType::I64 => 8,
        }
    }
    /// numpy dtype string (explicitly little-endian).
    pub fn numpy(self) -> &'static str {
        match self {
            DType::U8 => "u1",
            DType::U32 => "<u4",
            DType::I32 => "<i4",
            DType::F32 => "<f4",
            DType::I64 => "<i8",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SchemaError {
    #[error("message of {need} bytes does not fit a slot of {cap} bytes")]
    TooLarge { need: usize, cap: usize },
    #[error("corrupt payload: {0}")]
    Corrupt(String),
    #[error("bad arrays: {0}")]
    BadArrays(String),
}

/// A column element: fixed size, little-endian.
pub trait Scalar: Copy + Default + PartialEq + Debug {
    const DTYPE: DType;
    fn put(self, out: &mut [u8]);
    fn get(b: &[u8]) -> Self;
}

macro_rules! scalar {
    ($t:ty, $d:expr) => {
        impl Scalar for $t {
            const DTYPE: DType = $d;
            fn put(self, out: &mut [u8]) {
                out.copy_from_slice(&self.to_le_bytes());
            }
            fn get(b: &[u8]) -> Self {
                let mut a = [0u8; std::mem::size_of::<$t>()];
                a.copy_from_slice(b);
                <$t>::from_le_bytes(a)
            }
        }
    };
}
scalar!(u8, DType::U8);
scalar!(u32, DType::U32);
scalar!(i32, DType::I32);
scalar!(f32, DType::F32);
scalar!(i64, DType::I64);

impl Scalar for bool {
    const DTYPE: DType = DType::U8;
    fn put(self, out: &mut [u8]) {
        out[0] = u8::from(self);
    }
    fn get(b: &[u8]) -> Self {
        b[0] != 0
    }
}

/// One declared field of a section.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    pub name: &'static str,
    pub dtype: DType,
    /// A variable-length list per row (else one scalar per row).
    pub list: bool,
}

/// A section of a message: rows of one type, declared with `section!`.
pub trait Section: Sized + Default + Clone {
    const NAME: &'static str;
    const FIELDS: &'static [Field];
    /// Total elements of each list field over `rows`, in declaration order.
    fn list_totals(rows: &[Self]) -> Vec<usize>;
    fn encode(rows: &[Self], w: &mut Writer<'_>);
    fn decode(r: &mut Reader<'_>, rows: usize) -> Vec<Self>;
}

/// Where one array lies in a payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArrayDesc {
    /// `{section}_{field}` (or `{section}_{field}_len` for a list's lengths).
    pub name: String,
    pub dtype: DType,
    /// Byte offset from the start of the payload (a multiple of 8).
    pub offset: usize,
    /// Number of elements.
    pub count: usize,
}

/// The arrays of one encoded message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub step_id: u64,
    pub arrays: Vec<ArrayDesc>,
    /// Bytes the whole payload takes.
    pub total: usize,
}

impl Layout {
    pub fn array(&self, name: &str) -> Option<&ArrayDesc> {
        self.arrays.iter().find(|a| a.name == name)
    }
}

fn align8(n: usize) -> usize {
    (n + 7) & !7
}

const HEADER: usize = 16;

/// The declared shape of a message: its sections' names and fields, in order.
#[derive(Debug, Clone, Copy)]
pub struct SectionDesc {
    pub name: &'static str,
    pub fields: &'static [Field],
}

impl SectionDesc {
    pub const fn of<S: Section>() -> SectionDesc {
        SectionDesc {
            name: S::NAME,
            fields: S::FIELDS,
        }
    }
    fn n_lists(&self) -> usize {
        self.fields.iter().filter(|f| f.list).count()
    }
}

/// Number of counts in the header of a message with these sections.
fn n_counts(sections: &[SectionDesc]) -> usize {
    sections.iter().map(|s| 1 + s.n_lists()).sum()
}

/// Array names and dtypes of a message, in payload order (what Python is told).
pub fn array_names(sections: &[SectionDesc]) -> Vec<(String, DType)> {
    let mut out = Vec::new();
    for s in sections {
        for f in s.fields {
            let name = format!("{}_{}", s.name, f.name);
            if f.list {
                out.push((format!("{name}_len"), DType::U32));
            }
            out.push((name, f.dtype));
        }
    }
    out
}

/// The layout of a message with these sections and counts (see the module doc).
pub fn layout(sections: &[SectionDesc], step_id: u64, counts: &[usize]) -> Layout {
    debug_assert_eq!(counts.len(), n_counts(sections));
    let mut off = align8(HEADER + 4 * counts.len());
    let mut arrays = Vec::new();
    let mut c = counts.iter().copied();
    let mut push = |name: String, dtype: DType, count: usize, off: &mut usize| {
        arrays.push(ArrayDesc {
            name,
            dtype,
            offset: *off,
            count,
        });
        *off = align8(*off + count * dtype.size());
    };
    for s in sections {
        let rows = c.next().unwrap_or(0);
        let totals: Vec<usize> = c.by_ref().take(s.n_lists()).collect();
        let mut lists = totals.into_iter();
        for f in s.fields {
            let name = format!("{}_{}", s.name, f.name);
            if f.list {
                push(format!("{name}_len"), DType::U32, rows, &mut off);
                push(name, f.dtype, lists.next().unwrap_or(0), &mut off);
            } else {
                push(name, f.dtype, rows, &mut off);
            }
        }
    }
    Layout {
        step_id,
        arrays,
        total: off,
    }
}

fn get_u32(buf: &[u8], off: usize) -> u32 {
    u32::get(&buf[off..off + 4])
}

/// Reads and checks the header of a payload; returns its layout.
pub fn layout_of(sections: &[SectionDesc], magic: u32, buf: &[u8]) -> Result<Layout, SchemaError> {
    let n = n_counts(sections);
    if buf.len() < HEADER || get_u32(buf, 0) != magic {
        return Err(SchemaError::Corrupt(format!("magic {:#x} expected", magic)));
    }
    if get_u32(buf, 4) as usize != n || buf.len() < HEADER + 4 * n {
        return Err(SchemaError::Corrupt(format!(
            "{} counts in the header, the schema has {n}",
            get_u32(buf, 4)
        )));
    }
    let step_id = u64::from_le_bytes(buf[8..16].try_into().unwrap_or_default());
    let counts: Vec<usize> = (0..n)
        .map(|i| get_u32(buf, HEADER + 4 * i) as usize)
        .collect();
    let lay = layout(sections, step_id, &counts);
    if lay.total > buf.len() {
        return Err(SchemaError::Corrupt(format!(
            "payload needs {} bytes, has {}",
            lay.total,
            buf.len()
        )));
    }
    // List lengths must add up to the list totals, or a reader would run off its array.
    for w in lay.arrays.windows(2) {
        if let Some(base) = w[0].name.strip_suffix("_len") {
            if base == w[1].name {
                let sum: usize = array_bytes(buf, &w[0])
                    .chunks_exact(4)
                    .map(|c| u32::get(c) as usize)
                    .sum();
                if sum != w[1].count {
                    return Err(SchemaError::Corrupt(format!(
                        "{}: lengths add up to {sum}, the array has {}",
                        w[1].name, w[1].count
                    )));
                }
            }
        }
    }
    Ok(lay)
}

fn array_bytes<'a>(buf: &'a [u8], a: &ArrayDesc) -> &'a [u8] {
    &buf[a.offset..a.offset + a.count * a.dtype.size()]
}

fn write_header(buf: &mut [u8], magic: u32, step_id: u64, counts: &[usize]) {
    magic.put(&mut buf[0..4]);
    (counts.len() as u32).put(&mut buf[4..8]);
    buf[8..16].copy_from_slice(&step_id.to_le_bytes());
    for (i, &c) in counts.iter().enumerate() {
        (c as u32).put(&mut buf[HEADER + 4 * i..HEADER + 4 * i + 4]);
    }
}

fn check_fits(lay: &Layout, counts: &[usize], cap: usize) -> Result<(), SchemaError> {
    if lay.total > cap || counts.iter().any(|&c| c > u32::MAX as usize) {
        return Err(SchemaError::TooLarge {
            need: lay.total,
            cap,
        });
    }
    Ok(())
}

/// Writes a message's arrays in layout order (used by `section!`-generated code).
pub struct Writer<'a> {
    buf: &'a mut [u8],
    arrays: std::slice::Iter<'a, ArrayDesc>,
}

impl Writer<'_> {
    fn next(&mut self) -> ArrayDesc {
        self.arrays
            .next()
            .cloned()
            .expect("sections write exactly the arrays of their layout")
    }

    pub fn scalars<T: Scalar>(&mut self, vals: impl Iterator<Item = T>) {
        let a = self.next();
        let n = T::DTYPE.size();
        let dst = &mut self.buf[a.offset..a.offset + a.count * n];
        for (chunk, v) in dst.chunks_exact_mut(n).zip(vals) {
            v.put(chunk);
        }
    }

    pub fn lists<'v, T: Scalar + 'v>(&mut self, rows: impl Iterator<Item = &'v [T]> + Clone) {
        self.scalars(rows.clone().map(|r| r.len() as u32));
        self.scalars(rows.flat_map(|r| r.iter().copied()));
    }
}

/// Reads a message's arrays in layout order (used by `section!`-generated code).
pub struct Reader<'a> {
    buf: &'a [u8],
    arrays: std::slice::Iter<'a, ArrayDesc>,
}

impl<'a> Reader<'a> {
    fn next(&mut self) -> Option<&'a ArrayDesc> {
        self.arrays.next()
    }

    pub fn scalars<T: Scalar>(&mut self) -> Vec<T> {
        match self.next() {
            Some(a) => array_bytes(self.buf, a)
                .chunks_exact(T::DTYPE.size())
                .map(T::get)
                .collect(),
            None => Vec::new(),
        }
    }

    /// Splits a list field's values by its lengths (checked to add up by `layout_of`).
    pub fn lists<T: Scalar>(&mut self) -> Vec<Vec<T>> {
        let lens: Vec<u32> = self.scalars();
        let vals: Vec<T> = self.scalars();
        let mut rest = &vals[..];
        lens.iter()
            .map(|&l| {
                let (mine, tail) = rest.split_at((l as usize).min(rest.len()));
                rest = tail;
                mine.to_vec()
            })
            .collect()
    }
}

/// A message of the schema: a step id and one row list per section, declared with `message!`.
pub trait Message: Sized {
    const MAGIC: u32;
    const SECTIONS: &'static [SectionDesc];
    fn step_id(&self) -> u64;
    fn counts(&self) -> Vec<usize>;
    fn encode_sections(&self, w: &mut Writer<'_>);
    fn decode_sections(step_id: u64, counts: &[usize], r: &mut Reader<'_>) -> Self;

    fn layout(&self) -> Layout {
        layout(Self::SECTIONS, self.step_id(), &self.counts())
    }

    fn encoded_len(&self) -> usize {
        self.layout().total
    }

    /// Encodes into `buf`; returns the bytes written.
    fn encode(&self, buf: &mut [u8]) -> Result<usize, SchemaError> {
        let counts = self.counts();
        let lay = layout(Self::SECTIONS, self.step_id(), &counts);
        check_fits(&lay, &counts, buf.len())?;
        write_header(buf, Self::MAGIC, self.step_id(), &counts);
        let mut w = Writer {
            buf,
            arrays: lay.arrays.iter(),
        };
        self.encode_sections(&mut w);
        Ok(lay.total)
    }

    fn decode(buf: &[u8]) -> Result<Self, SchemaError> {
        let lay = layout_of(Self::SECTIONS, Self::MAGIC, buf)?;
        let n = n_counts(Self::SECTIONS);
        let counts: Vec<usize> = (0..n)
            .map(|i| get_u32(buf, HEADER + 4 * i) as usize)
            .collect();
        let mut r = Reader {
            buf,
            arrays: lay.arrays.iter(),
        };
        Ok(Self::decode_sections(lay.step_id, &counts, &mut r))
    }

    fn layout_of(buf: &[u8]) -> Result<Layout, SchemaError> {
        layout_of(Self::SECTIONS, Self::MAGIC, buf)
    }

    /// Array names and dtypes, in payload order.
    fn array_names() -> Vec<(String, DType)> {
        array_names(Self::SECTIONS)
    }

    /// Bytes of the largest message whose counts are at most `max_counts` (schema order).
    fn max_encoded_len(max_counts: &[usize]) -> usize {
        layout(Self::SECTIONS, 0, max_counts).total
    }

    /// Encodes a message given as raw little-endian arrays by name (what the Python worker has
    /// from numpy). A missing array is all zeros (scalars) or empty lists; every array's length
    /// must agree with its section's row count and a list's values with its lengths.
    fn encode_arrays<'a>(
        step_id: u64,
        get: impl Fn(&str) -> Option<&'a [u8]>,
        buf: &mut [u8],
    ) -> Result<usize, SchemaError> {
        let mut counts = Vec::new();
        for s in Self::SECTIONS {
            let mut rows: Option<(usize, String)> = None;
            let mut totals = Vec::new();
            for f in s.fields {
                let name = format!("{}_{}", s.name, f.name);
                let (rows_here, arr) = if f.list {
                    let lens = get(&format!("{name}_len")).unwrap_or(&[]);
                    let vals = get(&name).unwrap_or(&[]);
                    let (lens_n, vals_n) = (
                        elements(lens, 4, &name)?,
                        elements(vals, f.dtype.size(), &name)?,
                    );
                    let sum: usize = lens.chunks_exact(4).map(|c| u32::get(c) as usize).sum();
                    if sum != vals_n {
                        return Err(SchemaError::BadArrays(format!(
                            "{name}: lengths add up to {sum}, {vals_n} values given"
                        )));
                    }
                    totals.push(vals_n);
                    (lens_n, format!("{name}_len"))
                } else {
                    (
                        elements(get(&name).unwrap_or(&[]), f.dtype.size(), &name)?,
                        name,
                    )
                };
                match &rows {
                    _ if rows_here == 0 && get(&arr).is_none() => {}
                    None => rows = Some((rows_here, arr)),
                    Some((n, first)) if *n != rows_here => {
                        return Err(SchemaError::BadArrays(format!(
                            "{arr} has {rows_here} rows, {first} has {n}"
                        )))
                    }
                    Some(_) => {}
                }
            }
            counts.push(rows.map_or(0, |r| r.0));
            counts.extend(totals);
        }
        let lay = layout(Self::SECTIONS, step_id, &counts);
        check_fits(&lay, &counts, buf.len())?;
        write_header(buf, Self::MAGIC, step_id, &counts);
        for a in &lay.arrays {
            let dst = &mut buf[a.offset..a.offset + a.count * a.dtype.size()];
            match get(&a.name) {
                Some(src) if src.len() == dst.len() => dst.copy_from_slice(src),
                _ => dst.fill(0),
            }
        }
        Ok(lay.total)
    }
}

fn elements(bytes: &[u8], size: usize, name: &str) -> Result<usize, SchemaError> {
    if !bytes.len().is_multiple_of(size) {
        return Err(SchemaError::BadArrays(format!(
            "{name}: {} bytes is not a whole number of {size}-byte elements",
            bytes.len()
        )));
    }
    Ok(bytes.len() / size)
}

/// Declares one section: the row struct and its column codec. Scalar fields first, then
/// `lists { .. }` of variable-length fields (each row holds a `Vec`).
#[macro_export]
macro_rules! section {
    (
        $(#[$meta:meta])*
        pub struct $name:ident ($key:literal) {
            $( $(#[$fmeta:meta])* pub $field:ident : $ty:ty, )*
        }
        lists {
            $( $(#[$lmeta:meta])* pub $lfield:ident : Vec<$lty:ty>, )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Default, PartialEq)]
        pub struct $name {
            $( $(#[$fmeta])* pub $field: $ty, )*
            $( $(#[$lmeta])* pub $lfield: Vec<$lty>, )*
        }

        impl $crate::schema::Section for $name {
            const NAME: &'static str = $key;
            const FIELDS: &'static [$crate::schema::Field] = &[
                $( $crate::schema::Field {
                    name: stringify!($field),
                    dtype: <$ty as $crate::schema::Scalar>::DTYPE,
                    list: false,
                }, )*
                $( $crate::schema::Field {
                    name: stringify!($lfield),
                    dtype: <$lty as $crate::schema::Scalar>::DTYPE,
                    list: true,
                }, )*
            ];
            #[allow(unused_variables)]
            fn list_totals(rows: &[Self]) -> Vec<usize> {
                vec![ $( rows.iter().map(|r| r.$lfield.len()).sum::<usize>(), )* ]
            }
            #[allow(unused_variables)]
            fn encode(rows: &[Self], w: &mut $crate::schema::Writer<'_>) {
                $( w.scalars(rows.iter().map(|r| r.$field)); )*
                $( w.lists(rows.iter().map(|r| r.$lfield.as_slice())); )*
            }
            #[allow(unused_mut, unused_variables)]
            fn decode(r: &mut $crate::schema::Reader<'_>, rows: usize) -> Vec<Self> {
                let mut out = vec![Self::default(); rows];
                $( for (row, v) in out.iter_mut().zip(r.scalars::<$ty>()) { row.$field = v; } )*
                $( for (row, v) in out.iter_mut().zip(r.lists::<$lty>()) { row.$lfield = v; } )*
                out
            }
        }
    };
}

/// Declares one message: a step id plus one `Vec` of rows per section, in payload order.
#[macro_export]
macro_rules! message {
    (
        $(#[$meta:meta])*
        pub struct $name:ident (magic = $magic:expr) {
            $( $(#[$fmeta:meta])* pub $field:ident : Vec<$sec:ty>, )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Default, PartialEq)]
        pub struct $name {
            pub step_id: u64,
            $( $(#[$fmeta])* pub $field: Vec<$sec>, )*
        }

        impl $crate::schema::Message for $name {
            const MAGIC: u32 = $magic;
            const SECTIONS: &'static [$crate::schema::SectionDesc] =
                &[ $( $crate::schema::SectionDesc::of::<$sec>(), )* ];
            fn step_id(&self) -> u64 {
                self.step_id
            }
            fn counts(&self) -> Vec<usize> {
                let mut c = Vec::new();
                $(
                    c.push(self.$field.len());
                    c.extend(<$sec as $crate::schema::Section>::list_totals(&self.$field));
                )*
                c
            }
            fn encode_sections(&self, w: &mut $crate::schema::Writer<'_>) {
                $( <$sec as $crate::schema::Section>::encode(&self.$field, w); )*
            }
            #[allow(unused_assignments)]
            fn decode_sections(
                step_id: u64,
                counts: &[usize],
                r: &mut $crate::schema::Reader<'_>,
            ) -> Self {
                let mut at = 0;
                $(
                    let $field = <$sec as $crate::schema::Section>::decode(r, counts[at]);
                    at += 1 + <$sec as $crate::schema::Section>::FIELDS
                        .iter()
                        .filter(|f| f.list)
                        .count();
                )*
                $name { step_id, $( $field, )* }
            }
        }
    };
}
