//! What an API server's refusal means to a controller, by HTTP status code.
//!
//! By code, not by kube's `Status::is_not_found` / `is_conflict`: those go by the `reason` first, and a create whose
//! name is taken answers 409 with reason `AlreadyExists`, which `is_conflict` does not count — while every caller
//! here treats "the name is taken" and "the object moved on" (a failed precondition) alike: someone else got there
//! first, read again.

/// 404: the object (or its namespace) does not exist.
pub fn is_not_found(e: &kube::Error) -> bool {
    has_code(e, 404)
}

/// 409: the name is taken (create) or the object changed since it was read (a resourceVersion or UID precondition).
pub fn is_conflict(e: &kube::Error) -> bool {
    has_code(e, 409)
}

fn has_code(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(status) if status.code == code)
}
