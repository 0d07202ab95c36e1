//! Whether a CUDA driver is present, found without touching burn-cuda (which panics at device
//! creation when there is no driver): dlopen libcuda and ask it for devices.

/// Why CUDA can or cannot be used here, in words for a log line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CudaProbe {
    Available { devices: i32 },
    Unavailable { reason: String },
}

impl CudaProbe {
    pub fn is_available(&self) -> bool {
        matches!(self, CudaProbe::Available { .. })
    }
}

/// Loads the driver library and calls `cuInit` and `cuDeviceGetCount`.
pub fn probe_cuda() -> CudaProbe {
    if std::env::var_os("HEADROOM_DISABLE_CUDA").is_some() {
        return CudaProbe::Unavailable {
            reason: "HEADROOM_DISABLE_CUDA is set".into(),
        };
    }
    // SAFETY: libcuda's documented C entry points, called with valid arguments; the library
    // stays loaded for the process (dropping it while CUDA state exists is unsafe).
    unsafe {
        let lib = match libloading::Library::new("libcuda.so.1")
            .or_else(|_| libloading::Library::new("libcuda.so"))
        {
            Ok(lib) => lib,
            Err(_) => {
                return CudaProbe::Unavailable {
                    reason: "no NVIDIA driver found (libcuda.so.1 is not installed)".into(),
                }
            }
        };
        type CuInit = unsafe extern "C" fn(u32) -> i32;
        type CuDeviceGetCount = unsafe extern "C" fn(*mut i32) -> i32;
        let (Ok(init), Ok(count)) = (
            lib.get::<CuInit>(b"cuInit\0"),
            lib.get::<CuDeviceGetCount>(b"cuDeviceGetCount\0"),
        ) else {
            return CudaProbe::Unavailable {
                reason: "libcuda has no cuInit/cuDeviceGetCount".into(),
            };
        };
        let rc = init(0);
        if rc != 0 {
            return CudaProbe::Unavailable {
                reason: format!("the NVIDIA driver failed to initialise (cuInit error {rc})"),
            };
        }
        let mut devices = 0;
        let rc = count(&mut devices);
        std::mem::forget(lib);
        if rc != 0 || devices == 0 {
            return CudaProbe::Unavailable {
                reason: "the NVIDIA driver reports no CUDA devices".into(),
            };
        }
        CudaProbe::Available { devices }
    }
}

/// The theoretical memory bandwidth of CUDA device `index` in bytes/s, from the driver's memory
/// clock and bus width (double data rate): the bound a decode step that reads every weight
/// once is measured against. `None` without a driver or device.
pub fn cuda_memory_bandwidth(index: i32) -> Option<f64> {
    if !probe_cuda().is_available() {
        return None;
    }
    // CUdevice_attribute values from cuda.h.
    const MEMORY_CLOCK_RATE_KHZ: i32 = 36;
    const GLOBAL_MEMORY_BUS_WIDTH_BITS: i32 = 37;
    // SAFETY: as in `probe_cuda`; the driver is initialised there.
    unsafe {
        let lib = libloading::Library::new("libcuda.so.1").or_else(|_| libloading::Library::new("libcuda.so")).ok()?;
        type CuDeviceGet = unsafe extern "C" fn(*mut i32, i32) -> i32;
        type CuDeviceGetAttribute = unsafe extern "C" fn(*mut i32, i32, i32) -> i32;
        let get = lib.get::<CuDeviceGet>(b"cuDeviceGet\0").ok()?;
        let attribute = lib.get::<CuDeviceGetAttribute>(b"cuDeviceGetAttribute\0").ok()?;
        let mut device = 0;
        if get(&mut device, index) != 0 {
            return None;
        }
        let (mut clock_khz, mut bus_bits) = (0, 0);
        if attribute(&mut clock_khz, MEMORY_CLOCK_RATE_KHZ, device) != 0 || attribute(&mut bus_bits, GLOBAL_MEMORY_BUS_WIDTH_BITS, device) != 0 {
            return None;
        }
        std::mem::forget(lib);
        Some(2.0 * clock_khz as f64 * 1000.0 * bus_bits as f64 / 8.0)
    }
}
