//! Collectives on the CUDA backend: NCCL, one communicator per device, all in one process.
//!
//! The group is created by `ncclCommInitAll` over the devices' ordinals. Each collective is issued
//! on the HAL stream's `CUstream` with the device's context current, so it is ordered with the
//! stream's other work and, on a capturing stream, recorded into the graph (NCCL supports stream
//! capture). A graph that recorded a collective holds the communicator, which is destroyed
//! (`ncclCommDestroy`) only after the last graph and handle are gone.
//!
//! NCCL is blocking per rank on the GPU, not on the host: a collective returns once enqueued, and
//! the kernel waits on the device for the other ranks. Drive each rank from its own host thread
//! (as on the CPU backend); enqueuing several ranks' collectives from one thread needs NCCL group
//! calls, which the HAL does not issue. NCCL sets up its connections between ranks lazily, at a
//! communicator's first collectives: run each collective once eagerly before capturing it (the
//! warm-up the graph runner does anyway).

use std::ffi::c_int;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::CudaContext;
use cudarc::nccl::sys::{cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t};

use super::nccl::{self, Nccl};
use crate::backend::{wrong_backend, CommImpl, CommOps, DeviceImpl, StreamImpl};
use crate::comm::{CollectiveCall, CollectiveKind, ReduceOp};
use crate::device::{lock, Device};
use crate::dtype::DType;
use crate::error::{HalError, Result};

/// One `ncclComm_t`, destroyed once when the last handle (communicator or graph) goes.
struct RawComm {
    nccl: &'static Nccl,
    comm: ncclComm_t,
}

// SAFETY: an NCCL communicator may be used from any thread; every use goes through the `Mutex` in
// `CudaComm`, so calls on one communicator never run concurrently (NCCL requires that).
unsafe impl Send for RawComm {}

impl Drop for RawComm {
    fn drop(&mut self) {
        if !self.comm.is_null() {
            // SAFETY: created by ncclCommInitAll, destroyed exactly once, after every graph that
            // recorded work on it (graphs hold the communicator).
            let _ = unsafe { (self.nccl.comm_destroy)(self.comm) };
        }
    }
}

/// One rank: its NCCL communicator and its device's context.
pub(crate) struct CudaComm {
    ctx: Arc<CudaContext>,
    comm: Arc<Mutex<RawComm>>,
}

/// Creates one communicator per device (rank `i` on `devices[i]`, all CUDA, distinct).
pub(crate) fn group(devices: &[Device]) -> Result<Vec<CommImpl>> {
    let mut ctxs = Vec::with_capacity(devices.len());
    let mut ordinals: Vec<c_int> = Vec::with_capacity(devices.len());
    for (i, d) in devices.iter().enumerate() {
        #[allow(unreachable_patterns)]
        let ctx = match &d.shared.inner {
            DeviceImpl::Cuda(c) => c.ctx.clone(),
            _ => return Err(wrong_backend("device")),
        };
        let ordinal = d.info().ordinal;
        if let Some(j) = devices[..i].iter().position(|e| e.info().ordinal == ordinal) {
            return Err(HalError::InvalidGroup(format!(
                "devices {j} and {i} are both cuda:{ordinal}; NCCL needs one device per rank"
            )));
        }
        ordinals.push(c_int::try_from(ordinal).map_err(|_| HalError::InvalidGroup(format!("ordinal {ordinal}")))?);
        ctxs.push(ctx);
    }
    let nccl = nccl::load().map_err(|reason| HalError::BackendUnavailable { backend: "cuda", reason })?;
    let n = c_int::try_from(devices.len())
        .map_err(|_| HalError::InvalidGroup(format!("{} devices is too many", devices.len())))?;
    let mut comms: Vec<ncclComm_t> = vec![std::ptr::null_mut(); devices.len()];
    // SAFETY: `comms` has room for `n` handles and `ordinals` holds `n` distinct, valid ordinals.
    let rc = unsafe { (nccl.comm_init_all)(comms.as_mut_ptr(), n, ordinals.as_ptr()) };
    // ncclCommInitAll switches this thread's current device; give the caller its context back.
    if let Some(ctx) = ctxs.first() {
        ctx.bind_to_thread().map_err(super::drv("cuCtxSetCurrent"))?;
    }
    if rc != 0 {
        return Err(HalError::Driver {
            call: "ncclCommInitAll",
            code: i64::from(rc),
            message: format!("{} (NCCL {} from {})", nccl.describe(rc, std::ptr::null_mut()), nccl.version, nccl.path),
        });
    }
    Ok(comms
        .into_iter()
        .zip(ctxs)
        .map(|(comm, ctx)| CommImpl::Cuda(CudaComm { ctx, comm: Arc::new(Mutex::new(RawComm { nccl, comm })) }))
        .collect())
}

fn nccl_type(dtype: DType) -> Result<ncclDataType_t> {
    match dtype {
        DType::F32 => Ok(ncclDataType_t::ncclFloat32),
        DType::BF16 => Ok(ncclDataType_t::ncclBfloat16),
        DType::F16 => Ok(ncclDataType_t::ncclFloat16),
        other => Err(HalError::Unsupported(format!("NCCL collectives of {other}"))),
    }
}

fn nccl_op(op: ReduceOp) -> ncclRedOp_t {
    match op {
        ReduceOp::Sum => ncclRedOp_t::ncclSum,
    }
}

impl CommOps for CudaComm {
    fn collective(&self, stream: &StreamImpl, call: &CollectiveCall) -> Result<()> {
        #[allow(unreachable_patterns)]
        let stream = match stream {
            StreamImpl::Cuda(s) => s,
            _ => return Err(wrong_backend("stream")),
        };
        let dt = nccl_type(call.dtype)?;
        self.ctx.bind_to_thread().map_err(super::drv("cuCtxSetCurrent"))?;
        let raw_stream: cudaStream_t = stream.raw()?.cast();
        let guard = lock(&self.comm);
        let (nccl, comm) = (guard.nccl, guard.comm);
        let (send, recv) = (call.send as *const std::ffi::c_void, call.recv as *mut std::ffi::c_void);
        // SAFETY (every arm): `send` and `recv` are live device allocations of this rank's device
        // holding `send_count` and `recv_count` elements, sized for the collective by the front
        // end and retained by any graph that records it; the stream belongs to the comm's device,
        // whose context is current; the mutex guard serialises calls on this communicator.
        let (name, rc) = match call.kind {
            CollectiveKind::AllReduce => {
                let op = nccl_op(call.op);
                // SAFETY: see above (`recv` holds `send_count` elements).
                let rc = unsafe { (nccl.all_reduce)(send, recv, call.send_count, dt, op, comm, raw_stream) };
                ("ncclAllReduce", rc)
            }
            CollectiveKind::AllGather => {
                // SAFETY: see above (`recv` holds size · `send_count` elements).
                let rc = unsafe { (nccl.all_gather)(send, recv, call.send_count, dt, comm, raw_stream) };
                ("ncclAllGather", rc)
            }
            CollectiveKind::ReduceScatter => {
                let op = nccl_op(call.op);
                // SAFETY: see above (`send` holds size · `recv_count` elements).
                let rc = unsafe { (nccl.reduce_scatter)(send, recv, call.recv_count, dt, op, comm, raw_stream) };
                ("ncclReduceScatter", rc)
            }
        };
        if rc != 0 {
            return Err(HalError::Driver { call: name, code: i64::from(rc), message: nccl.describe(rc, comm) });
        }
        Ok(())
    }

    fn timeout(&self) -> Option<Duration> {
        None
    }

    fn set_timeout(&self, _timeout: Duration) {}
}
