//! A named POSIX shared-memory mapping (shm_open + mmap) and the cross-process futex calls.

use std::ffi::CString;
use std::io;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

use crate::IpcError;

/// One mapping of a `/dev/shm` segment. The creator unlinks the name on drop.
pub(crate) struct Segment {
    ptr: *mut u8,
    len: usize,
    fd: libc::c_int,
    name: CString,
    owner: bool,
}

// SAFETY: the mapping is plain memory shared with other processes anyway; every access to
// it goes through atomics or through the ring protocol, which gives one side exclusive use
// of a slot at a time. The raw pointer itself is never re-pointed after construction.
unsafe impl Send for Segment {}
// SAFETY: see `Send`; `&Segment` only hands out the base pointer and the length.
unsafe impl Sync for Segment {}

fn os_err(op: &'static str, name: &str) -> IpcError {
    IpcError::Os {
        op,
        name: name.to_string(),
        source: io::Error::last_os_error(),
    }
}

/// `"foo"` or `"/foo"` → `"/foo"`; one path component, at most 255 bytes, no NUL.
fn shm_name(name: &str) -> Result<CString, IpcError> {
    let bare = name.strip_prefix('/').unwrap_or(name);
    if bare.is_empty() || bare.len() > 254 || bare.contains('/') || bare.contains('\0') {
        return Err(IpcError::InvalidName(name.to_string()));
    }
    CString::new(format!("/{bare}")).map_err(|_| IpcError::InvalidName(name.to_string()))
}

impl Segment {
    /// Creates a zero-filled segment of `len` bytes, replacing any stale one of that name.
    pub(crate) fn create(name: &str, len: usize) -> Result<Segment, IpcError> {
        let cname = shm_name(name)?;
        // SAFETY: `cname` is a valid NUL-terminated string; unlink of a missing name is harmless.
        unsafe { libc::shm_unlink(cname.as_ptr()) };
        let flags = libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC;
        // SAFETY: valid C string, plain flags and mode.
        let fd = unsafe { libc::shm_open(cname.as_ptr(), flags, 0o600 as libc::mode_t) };
        if fd < 0 {
            return Err(os_err("shm_open(create)", name));
        }
        // SAFETY: `fd` is the descriptor we just opened.
        if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
            let err = os_err("ftruncate", name);
            // SAFETY: cleanup of what we created above.
            unsafe {
                libc::close(fd);
                libc::shm_unlink(cname.as_ptr());
            }
            return Err(err);
        }
        match Self::map(fd, len, name) {
            Ok(ptr) => Ok(Segment {
                ptr,
                len,
                fd,
                name: cname,
                owner: true,
            }),
            Err(e) => {
                // SAFETY: cleanup of what we created above.
                unsafe {
                    libc::close(fd);
                    libc::shm_unlink(cname.as_ptr());
                }
                Err(e)
            }
        }
    }

    /// Maps an existing segment by name, whole.
    pub(crate) fn open(name: &str) -> Result<Segment, IpcError> {
        let cname = shm_name(name)?;
        // SAFETY: valid C string, plain flags.
        let fd = unsafe { libc::shm_open(cname.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC, 0) };
        if fd < 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ENOENT) {
                return Err(IpcError::NotFound(name.to_string()));
            }
            return Err(IpcError::Os {
                op: "shm_open",
                name: name.to_string(),
                source: err,
            });
        }
        let len = match fd_identity(fd) {
            Some((_, _, size)) => size as usize,
            None => {
                let err = os_err("fstat", name);
                // SAFETY: closing the descriptor we opened.
                unsafe { libc::close(fd) };
                return Err(err);
            }
        };
        if len == 0 {
            // SAFETY: closing the descriptor we opened.
            unsafe { libc::close(fd) };
            return Err(IpcError::NotReady(name.to_string()));
        }
        match Self::map(fd, len, name) {
            Ok(ptr) => Ok(Segment {
                ptr,
                len,
                fd,
                name: cname,
                owner: false,
            }),
            Err(e) => {
                // SAFETY: closing the descriptor we opened.
                unsafe { libc::close(fd) };
                Err(e)
            }
        }
    }

    fn map(fd: libc::c_int, len: usize, name: &str) -> Result<*mut u8, IpcError> {
        // SAFETY: a fresh shared mapping of `len` bytes of `fd`; the kernel picks the address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(os_err("mmap", name));
        }
        Ok(ptr.cast())
    }

    pub(crate) fn base(&self) -> *mut u8 {
        self.ptr
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The name as given to `shm_open` (with the leading `/`).
    pub(crate) fn name(&self) -> &str {
        self.name.to_str().unwrap_or("")
    }
}

/// (device, inode, size) of an open descriptor.
fn fd_identity(fd: libc::c_int) -> Option<(u64, u64, u64)> {
    // SAFETY: `stat` is plain data; fstat fills it in or fails.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is open and `st` is a valid out-pointer.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return None;
    }
    Some((st.st_dev as u64, st.st_ino as u64, st.st_size as u64))
}

impl Drop for Segment {
    fn drop(&mut self) {
        if self.owner {
            // Unlink only if the name still points at *our* segment (a newer server may have
            // replaced it).
            // SAFETY: valid C string; the probe descriptor is closed right after.
            unsafe {
                let probe = libc::shm_open(self.name.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC, 0);
                if probe >= 0 {
                    let same = match (fd_identity(probe), fd_identity(self.fd)) {
                        (Some(a), Some(b)) => a.0 == b.0 && a.1 == b.1,
                        _ => false,
                    };
                    libc::close(probe);
                    if same {
                        libc::shm_unlink(self.name.as_ptr());
                    }
                }
            }
        }
        // SAFETY: `ptr`/`len` are the mapping made in `map`, unmapped once, here.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
            libc::close(self.fd);
        }
    }
}

/// Sleeps while `*word == expected`, at most `timeout` (None: until woken).
/// Returns on wake-up, value change, timeout or signal; the caller re-checks its condition.
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) {
    let ts = timeout.map(|d| libc::timespec {
        tv_sec: d.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_nsec: d.subsec_nanos() as libc::c_long,
    });
    let ts_ptr = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: `word` is a live, 4-byte aligned u32 in a MAP_SHARED mapping (hence the
    // non-private futex op, keyed by the physical page); `ts_ptr` is null or points at `ts`.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            ts_ptr,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wakes every process/thread sleeping on `word`.
pub(crate) fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: `word` is a live, aligned u32 in shared memory; FUTEX_WAKE only reads the address.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// True when `pid` names a live process (or one we may not signal, which is alive too).
pub(crate) fn pid_alive(pid: i32) -> bool {
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 only checks for existence and permission.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

pub(crate) fn my_pid() -> i32 {
    // SAFETY: getpid cannot fail.
    unsafe { libc::getpid() }
}
