/**
 * Desktop notifications (the browser's Notification API) while this tab is hidden. Permission is asked for
 * once, with the reason, from a button in JupyterLab's notification center (a user gesture), never on load.
 */

import { Notification } from '@jupyterlab/apputils';

import { INotice } from './messages';

/** Set once the offer was shown, so it is never shown again in this browser (the command asks any time). */
const ASKED_KEY = 'jupyter-gpulease:desktop-notifications-asked';

function browserNotifications(): typeof window.Notification | null {
  return typeof window !== 'undefined' && 'Notification' in window ? window.Notification : null;
}

export class DesktopNotifier {
  /** The "desktop notifications" setting. */
  enabled = true;

  /** 'granted', 'denied', 'default', or 'unsupported' where the browser has no Notification API. */
  get permission(): string {
    return browserNotifications()?.permission ?? 'unsupported';
  }

  /** Tell `notice` on the desktop when this tab is hidden (and the user allowed it); true when told. */
  show(notice: INotice, onClick: () => void): boolean {
    const N = browserNotifications();
    if (!this.enabled || !N || N.permission !== 'granted' || document.visibilityState !== 'hidden') {
      return false;
    }
    try {
      const n = new N(notice.title, { body: notice.text, tag: notice.key });
      n.onclick = () => {
        window.focus();
        onClick();
        n.close();
      };
      return true;
    } catch (error) {
      // e.g. a browser that allows them only from a service worker: the notification center still has it
      console.warn('jupyter-gpulease: desktop notification failed', error);
      return false;
    }
  }

  /**
   * Offer desktop notifications once, when there is a reason to (you are about to wait or walk away): a message
   * in the notification center whose button asks the browser.
   */
  offerOnce(reason: string): void {
    if (!this.enabled || this.permission !== 'default' || this._asked()) {
      return;
    }
    try {
      window.localStorage.setItem(ASKED_KEY, String(Date.now()));
    } catch {
      // storage refused: the offer may come again next session, it still asks nothing by itself
    }
    Notification.info(
      `${reason} Allow desktop notifications to be told when it happens while this tab is in the background ` +
        '(you can turn them off in Settings → GPU leases).',
      {
        autoClose: false,
        actions: [
          {
            label: 'Allow desktop notifications',
            caption: 'Ask the browser to allow GPU lease notifications on the desktop',
            callback: () => void this.request()
          },
          { label: 'Not now', displayType: 'link', callback: () => undefined }
        ]
      }
    );
  }

  /** Ask the browser (call from a user gesture: a button or a command) and say what it answered. */
  async request(): Promise<string> {
    const N = browserNotifications();
    if (!N) {
      Notification.error('This browser has no desktop notifications.', { autoClose: 8000 });
      return 'unsupported';
    }
    const answer = N.permission === 'default' ? await N.requestPermission() : N.permission;
    if (answer === 'granted') {
      Notification.success('Desktop notifications allowed: GPU lease news reaches you while this tab is hidden.', {
        autoClose: 6000
      });
    } else {
      Notification.warning(
        `Desktop notifications are ${answer === 'denied' ? 'blocked' : 'not allowed'} by the browser: ` +
          'allow them in the site settings (the icon left of the address), then reload.',
        { autoClose: 10000 }
      );
    }
    return answer;
  }

  private _asked(): boolean {
    try {
      return window.localStorage.getItem(ASKED_KEY) !== null;
    } catch {
      return false;
    }
  }
}
